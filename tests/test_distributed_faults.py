"""A rank whose own loss is not finite skips the update together with the others (streamer.distributed):
without the agreement, A-GEM's rank returned early while the other waited in the gradient all-reduce,
and the learner hung. Two real gloo ranks under torchrun, a tiny LSTM, one torch thread each; rank 0's
second batch is made infinite by wrapping its loss."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RANK = """
import json, sys
sys.path.insert(0, {root!r})
import torch
from streamer import distributed
from streamer.models import LSTMLanguageModel
from streamer.models.catalog import LSTMConfig
from streamer.strategies import STRATEGIES
from streamer.strategies.base import Batch

ranks = distributed.start("cpu", timeout_s=30)  # a regression fails in 30 s instead of hanging
for name in {strategies!r}:
    torch.manual_seed(0)
    strategy = STRATEGIES[name](LSTMLanguageModel(LSTMConfig(embedding=8, hidden=16)), lr=1e-2)
    trainer = strategy._trainer
    loss_of = trainer.loss
    batch_number = [0]

    def loss(batch, state):  # rank 0's second batch: an infinite loss on that rank alone
        value, next_state = loss_of(batch, state)
        return (value * float("inf"), next_state) if ranks.rank == 0 and batch_number[0] == 1 else (value, next_state)

    trainer.loss = loss
    generator = torch.Generator().manual_seed(ranks.rank)
    skipped = []
    for number in range(4):
        batch_number[0] = number
        tokens = torch.randint(0, 256, (2, 9), generator=generator)
        skipped.append(bool(strategy.learn(Batch(tokens[:, :-1], tokens[:, 1:])).skipped))
    checksum = sum(float(p.detach().double().sum()) for p in strategy.model.parameters())
    # one write of the whole line: both ranks share the stdout pipe, and print's text and newline are two
    # writes when Python runs unbuffered (PYTHONUNBUFFERED), so two ranks' lines could interleave
    line = {{"rank": ranks.rank, "strategy": name, "skipped": skipped, "checksum": checksum}}
    sys.stdout.write(json.dumps(line) + "\\n")
    sys.stdout.flush()
distributed.stop()
"""


def two_ranks_run(tmp_path: Path, text: str) -> list[dict]:
    """`text` as a script run by two gloo ranks under torchrun; the JSON line each rank printed, by rank."""
    script = tmp_path / "rank.py"
    script.write_text(text)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path / "torchrun-logs"), str(script)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                  key=lambda report: report["rank"])


def test_a_rank_with_a_non_finite_loss_skips_with_the_others(tmp_path):
    strategies = ["agem", "naive"]  # one torchrun for both: each rank runs them one after the other
    reports = two_ranks_run(tmp_path, RANK.format(root=str(ROOT), strategies=strategies))
    for strategy in strategies:
        own = sorted((r for r in reports if r["strategy"] == strategy), key=lambda report: report["rank"])
        assert [report["rank"] for report in own] == [0, 1], strategy
        # both ranks skip the second batch, learn the others, and stay one model
        assert all(report["skipped"] == [False, True, False, False] for report in own), strategy
        assert own[0]["checksum"] == pytest.approx(own[1]["checksum"], abs=1e-9), strategy


AGREE = """
import json, sys
sys.path.insert(0, {root!r})
from streamer import distributed

ranks = distributed.start("cpu", timeout_s=30)
said = []
for size in (40, 2000, 0):  # fits the agreement; gathered apart (over VOTES_BYTES); rank 1 has no batch
    votes = (str(ranks.rank) * (size if ranks.rank == 0 else 7)).encode() if size or ranks.rank == 0 else b""
    agreed = ranks.agree(bool(votes), None, False, records=3, votes=votes)
    said.append([agreed.go, None if agreed.votes is None else [len(part) for part in agreed.votes]])
# every rank idle, rank 1 without a batch: the stream's end where the records add up to it, else idle
ends = [ranks.agree(ranks.rank == 0, None, False, records=3, more=False, total_records=total, idle=True).stop_reason
        for total in (6, 100)]
waited = [ranks.agree(True, None, False, records=3, waited=ranks.rank == 1 and one).waited for one in (True, False)]
sys.stdout.write(json.dumps({{"rank": ranks.rank, "said": said, "ends": ends, "waited": waited}}) + "\\n")
sys.stdout.flush()
distributed.stop()
"""


ENDS = ["end_of_stream", "idle"]  # (the stream's end said idle when its records were read long before)


def test_every_ranks_votes_reach_rank_0_with_the_agreement_and_long_ones_apart(tmp_path):
    """The global batch's truth: each rank sends its votes in the step's agreement (one all-gather); votes
    longer than VOTES_BYTES are gathered apart by every rank alike (each sees every length), so neither
    rank waits on a collective the other skips; only rank 0 keeps them, and only when all step. The
    stream's end, agreed where every rank is also idle, is the stream's end. One rank's word that it
    waited for its batch reaches every rank."""
    reports = two_ranks_run(tmp_path, AGREE.format(root=str(ROOT)))
    assert reports == [
        {"rank": 0, "said": [[True, [40, 7]], [True, [2000, 7]], [False, None]], "ends": ENDS, "waited": [True, False]},
        {"rank": 1, "said": [[True, None], [True, None], [False, None]], "ends": ENDS, "waited": [True, False]}]
