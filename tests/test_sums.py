"""monitor.sums: ExactSum gives math.fsum's value (or its exception) for every stream; CompensatedSum's mean."""

import math
import random

import pytest

from monitor.sums import CompensatedSum, ExactSum


def outcome(compute):
    try:
        value = compute()
    except (OverflowError, ValueError) as error:
        return type(error), str(error)
    return repr(value)


def exact(values):
    total = ExactSum()
    for value in values:
        total.add(value)
    return total


@pytest.mark.parametrize("values", [
    [], [0.1] * 10, [1e100, 1.0, -1e100], [-0.0],
    [1e308, 1e308],  # intermediate overflow: fsum raises OverflowError
    [1e308, 1e308, -1e308],  # was nan here
    [math.inf, 1e308, 1e308], [1e308, math.inf, 1e308],  # fsum drops the partials at an inf
    [math.inf, 1.0], [math.inf, -math.inf], [math.nan, 1.0], [math.inf, math.nan],
    [1.7976931348623157e308, 9.9e291],
])
def test_exact_sum_is_fsum_value_or_exception(values):
    assert outcome(exact(values).value) == outcome(lambda: math.fsum(values))
    assert exact(values).count == len(values)


def test_exact_sum_is_fsum_on_random_streams_with_specials_and_huge_values():
    rng = random.Random(5)
    pool = [math.inf, -math.inf, math.nan, 1e308, -1e308, 8.9e307, 1e-300, 0.0, -0.0]
    for _ in range(3000):
        values = [rng.choice(pool) if rng.random() < 0.3 else rng.uniform(-10, 10) * 10.0 ** rng.randint(-20, 20)
                  for _ in range(rng.randint(0, 12))]
        assert outcome(exact(values).value) == outcome(lambda: math.fsum(values)), values


def test_compensated_sum_mean_and_state():
    total = CompensatedSum()
    assert total.mean() is None
    for value in (0.1, 0.2, 0.3):
        total.add(value)
    assert total.mean() == pytest.approx(0.2, rel=1e-15)
    restored = CompensatedSum.from_state(total.state())
    assert restored.state() == total.state() and restored.mean() == total.mean()
