"""T and intransigence from the independent oracle run of the same seed, worked by hand."""

import pytest

from monitor.reference import add_oracle_reference, oracle_reference


def report(values, *, oracle=False, seed=0, run="run"):
    return {"oracle": oracle, "run": run, "config": {"seed": seed},
            "probe_matrix": {"classes": ["A", "B"], "stages": [3, 9], "values": values,
                             "unit": "held-out loss (nats)"},
            "forgetting": {"transfer": None, "intransigence": None, "notes": ["transfer is None: no reference"]}}


def test_the_oracle_diagonal_is_the_reference_and_fills_t_and_intransigence():
    oracle = report([[2.0, 5.0], [4.0, 1.5]], oracle=True, run="independent-seed0")
    naive = report([[2.5, 5.5], [3.0, 2.0]])
    other_seed = report([[2.5, 5.5], [3.0, 2.0]], seed=1)
    assert oracle_reference(oracle) == {"A": 2.0, "B": 1.5}
    assert add_oracle_reference([naive, oracle, other_seed]) == 1
    # scores are -loss. T (M'hamdi Eq. 2, classes 2..N): S[B][B] - ref[B] = -2.0 - (-1.5)
    assert naive["forgetting"]["transfer"] == pytest.approx(-0.5)
    # intransigence (Chaudhry): mean over k of ref[k] - S[k][k] = ((-2.0 + 2.5) + (-1.5 + 2.0)) / 2
    assert naive["forgetting"]["intransigence"] == pytest.approx(0.5)
    assert "independent-seed0" in naive["forgetting"]["reference"]
    assert not any(n.startswith("transfer is None") for n in naive["forgetting"]["notes"])
    assert other_seed["forgetting"]["transfer"] is None  # no oracle with seed 1
    assert oracle["forgetting"]["transfer"] is None  # the oracle is not its own contender
