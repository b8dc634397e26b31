"""benchmarks/soak.py at a tiny scale: its accounting by hand (fast), and the whole soak with poison, a
SIGKILL restart and an uninterrupted run to compare with (slow: real broker, three learner processes)."""

import importlib.util
import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

SOAK_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_benchmark", SOAK_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def write_log(path: Path, batches) -> None:
    path.write_text("".join(json.dumps({"loss": 1.0, "domain": 0, "domain_name": "a", "sequence": 0, "batch": b}) + "\n"
                            for b in batches))


def test_accounting_counts_lost_and_twice_learned(soak, tmp_path):
    log = tmp_path / "losses.jsonl"
    # offsets 0..11: poison at 3 and 11 (the closing one), ten good records in 5 batches of 2
    produced = soak.Produced(good=10, poison={3: "bad_key", 11: "nul_byte"}, end_offset=12)
    write_log(log, range(5))
    clean = soak.account(produced, [(3, "bad_key"), (3, "bad_key")], 11, soak.audit_log(log, 5), 5, True)
    assert (clean["records_lost"], clean["batches_learned_twice"], clean["records_learned"]) == (0, 0, 10)
    assert (clean["records_dead_lettered"], clean["dead_letter_copies"]) == (1, 2)
    write_log(log, [0, 1, 1, 3, 4])  # batch 1 twice, batch 2 missing
    audit = soak.audit_log(log, 5)
    assert (audit["twice"], audit["unique"]) == (1, 4)
    bad = soak.account(produced, [(5, "bad_key")], 9, audit, 5, True)
    # poison 3 read but not dead-lettered (1), good record 5 dead-lettered (1), batch 2's two records (2),
    # good records 9 and 10 never read (2)
    assert bad["records_lost"] == 6 and bad["records_unread"] == 2


@pytest.mark.slow
@pytest.mark.timeout(900)  # three learner processes and a restart's wait for the group; slower on a busy machine
def test_a_tiny_soak_loses_nothing_and_equals_an_uninterrupted_run(soak, tmp_path):
    args = Namespace(records=30000, minutes=14.0, kills=1, poison_every=100, record_bytes=10, streams=8, window=20,
                     hidden=16, embedding=8, layers=1, checkpoint_every=0.5, compare=True)
    lines = []
    figures = soak.soak(args, tmp_path, log=lines.append)
    assert figures["exit_code"] == 0, figures["stderr_tail"]
    assert figures["records_lost"] == 0 and figures["batches_learned_twice"] == 0
    assert figures["kills"] == 1 and figures["kept_before_kills"] == [True]
    assert figures["kill_steps"][0] < figures["total_batches"]
    assert figures["records_dead_lettered"] == figures["records_produced"] - figures["records_learned"] >= 110
    assert len(figures["dead_letter_reasons"]) >= 8
    worst, compared = figures["compare"]
    assert compared == figures["total_batches"] and worst <= 1e-4
    assert any(line.startswith("records lost: 0") for line in lines)
