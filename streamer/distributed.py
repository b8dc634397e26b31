"""N ranks as one learner (torch.distributed): which streams a rank owns, the per-step agreement, the
gradient and loss averages, and the bytes a checkpoint moves between ranks.

    torchrun --nproc-per-node 2 -m streamer learn --streams 10 ...   (or `streamer learn --nproc 2 ...`)

    rank r of N owns global stream ids r*s .. r*s+s-1 (s = streams / N) as its batcher's rows 0..s-1,
    reads only the partitions those streams are produced to (stream i -> partition i % partitions),
    and every step:  agree (all have a batch? anyone stopping? checkpoint now?)  ->  predict  ->
    learn (gradients averaged over ranks before clipping)  ->  the loss averaged over ranks.

Batch i of a stream is its bytes i*w .. i*w+w whatever order records arrive in, and the ranks' rows
are disjoint, so N ranks of s streams see the rows of one process's b = N*s streams; with equal
tokens per rank, the mean of the ranks' mean losses (and gradients) is the global batch's mean:
the same model and the same recorded losses as one process, to float rounding.

Every collective runs in the loop's worker thread, in the same order on every rank (agree, the step's
own, a checkpoint's gather); gloo on CPU, nccl on CUDA. Bytes between ranks are uint8 tensors of the
checkpoint module's serialisation (torch.save's format, loaded weights_only), never arbitrary pickled
objects. One process (no torchrun environment) has
no `Ranks`, and every function here is then a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from streamer.settings import torchrun_environment

__all__ = ["Ranks", "Agreement", "start", "current", "stop", "average_gradients", "mean_over_ranks", "ranks_count",
           "true_on_every_rank", "without_source_location", "STOP_REASONS", "STALL_S", "in_collective_since",
           "stalled_s"]

STALL_S = 5.0  # a collective waits this long only for a rank that is not there (stopped, hung, far slower)
_waits = {"since": None, "stalled_s": 0.0}  # the collective in progress (monotonic start), and past STALL_S


@contextlib.contextmanager
def _collective():
    """Time a collective of this process: a rank stopped (SIGSTOP), hung or far slower holds every other in
    its next one, agreement, gradient all-reduce or report alike, without a word (now the loop says it, from
    in_collective_since), and that wait was counted as compute ('64.7s computing' where the run computed
    30.6 s): the seconds past STALL_S are kept apart (stalled_s)."""
    _waits["since"] = started = time.monotonic()
    try:
        yield
    finally:
        _waits["since"] = None
        _waits["stalled_s"] += max(0.0, time.monotonic() - started - STALL_S)


def in_collective_since() -> float | None:
    """When (monotonic) this process entered the collective it is in; None when in none."""
    return _waits["since"]


def stalled_s() -> float:
    """The seconds this process's collectives have waited past STALL_S, in all: waiting for a rank, not work."""
    return _waits["stalled_s"]


# The stop reason all ranks take when several differ in one round: the later in this tuple wins.
STOP_REASONS = ("end_of_stream", "max_batches", "idle", "time_limit", "broker_lost", "log_changed", "codec_missing",
                "signal")

_current: Ranks | None = None


VOTES_BYTES = 512  # a rank's votes sent with each agreement (Ranks.agree); longer ones are gathered apart


@dataclass(frozen=True)
class Agreement:
    go: bool  # every rank has its next batch and none stops: all step
    stop_reason: str | None  # some rank stops: all stop, with this reason
    checkpoint: bool  # rank 0 asks for a checkpoint after this step
    report: bool = False  # rank 0 asks every rank for its report (gather_bytes) after this round
    votes: list[bytes] | None = None  # rank 0, when all step: every rank's `votes` for its part of the batch
    waited: bool = False  # some rank said it waited for its batch before this round


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of one learner."""

    rank: int
    world: int
    device: torch.device  # where collectives' tensors live (cpu for gloo, the rank's GPU for nccl)

    @property
    def leader(self) -> bool:
        """Rank 0: writes the run directory (checkpoint, loss log, status, metrics; no probes with ranks)."""
        return self.rank == 0

    def streams_per_rank(self, streams: int) -> int:
        """b / N; ValueError (one line) when b is not a multiple of N."""
        if streams % self.world:
            raise ValueError(f"--streams {streams} is not divisible by the {self.world} ranks "
                             f"(each rank learns streams / ranks of them); use a multiple of {self.world}")
        return streams // self.world

    def first_stream(self, streams: int) -> int:
        return self.rank * self.streams_per_rank(streams)

    def partitions(self, streams: int):
        """partitions(count) -> this rank's partitions of a topic with `count` partitions, the producer
        sending stream i to partition i % count; ValueError (one line) when a partition would hold
        streams of two ranks (the topic needs one partition per stream, or a multiple of N). A partition
        no stream maps to (more partitions than streams) is read by rank p % N, whose loop dead-letters
        its records as one process does (extra_stream): no rank read them, and they went unsaid."""
        per_rank = self.streams_per_rank(streams)

        def choose(count: int) -> list[int]:
            owner: dict[int, int] = {}
            for stream in range(streams):
                if owner.setdefault(stream % count, stream // per_rank) != stream // per_rank:
                    raise ValueError(f"the topic has {count} partitions: streams of two ranks share partition "
                                     f"{stream % count}; produce it with --partitions {streams} (one per stream)")
            first = self.rank * per_rank
            unowned = {partition for partition in range(streams, count) if partition % self.world == self.rank}
            return sorted({stream % count for stream in range(first, first + per_rank)} | unowned)

        return choose

    def agree(self, has_batch: bool, stop_reason: str | None, checkpoint: bool, records: int = 0,
              more: bool = True, total_records: int | None = None, report: bool = False,
              idle: bool = False, votes: bytes = b"", waited: bool = False) -> Agreement:
        """One round (one all-gather): all ranks step when every one has a batch and none stops; when
        one stops, all stop (the reason latest in STOP_REASONS); rank 0's `checkpoint` and `report` are
        everyone's. The stream ends for all when the ranks' `records` (batched) add up to
        `total_records` and one rank has no `more` (a whole batch cut or to cut): a global batch needs a
        part of every rank's (the part of a rank whose streams hold more tokens stays uncut, as one
        process would not cut it either; waiting for every rank to run out, the ranks of a word-level
        model, whose streams' token counts differ, waited for ever at the stream's end). All stop as idle when
        every rank is `idle` (no record read for --idle-timeout) and one has no batch: the learner as a
        whole has read nothing for that long and cannot cut its next global batch (one rank's quiet
        partitions alone do not stop the others, whose records still arrive), unless the stream has ended:
        its end is said as such however long ago its records were read. Rank 0 also gets every
        rank's `votes` (what its part of the next batch says of the batch's class: the global batch's truth)
        in the same collective, an all-gather: a gather of its own at each step cost the ranks 13% of their
        tokens/s on 2 CPUs. Blocking: call it in the worker thread."""
        stops = [0] * len(STOP_REASONS)
        if stop_reason is not None:
            stops[STOP_REASONS.index(stop_reason if stop_reason in STOP_REASONS else "signal")] = 1
        counts = [0 if has_batch else 1, int(checkpoint and self.leader), int(report and self.leader),
                  records, int(not more), int(idle), int(waited), *stops]
        gathered = self._gather_with(counts, votes)
        # GPU sync point (nccl): the agreement is read on the host, once per step.
        waiting, wanted, reported, records, exhausted, idle_ranks, waited_ranks, *stops = \
            gathered[:, :len(counts)].sum(0).tolist()
        if total_records and records >= total_records and exhausted:
            stops[STOP_REASONS.index("end_of_stream")] += 1
        elif waiting and idle_ranks == self.world:  # (the stream's end is not idle, however long its records
            stops[STOP_REASONS.index("idle")] += 1  # were all read before)
        if any(stops):
            stop = STOP_REASONS[max(i for i, count in enumerate(stops) if count)]
            return Agreement(False, stop, False, bool(reported))
        shared = self._votes_of(gathered, len(counts), votes) if not waiting else None
        return Agreement(not waiting, None, bool(wanted) and not waiting, bool(reported), shared, bool(waited_ranks))

    def _gather_with(self, counts: list[int], votes: bytes) -> torch.Tensor:
        """Every rank's `counts` and `votes` (up to VOTES_BYTES; its length either way), one all-gather:
        a (world, len(counts) + 1 + VOTES_BYTES / 8) int64 tensor on the host."""
        packed = torch.zeros(len(counts) + 1 + VOTES_BYTES // 8, dtype=torch.int64)
        packed[:len(counts)] = torch.tensor(counts, dtype=torch.int64)
        packed[len(counts)] = len(votes)
        if 0 < len(votes) <= VOTES_BYTES:
            packed[len(counts) + 1:].view(torch.uint8)[:len(votes)] = torch.frombuffer(bytearray(votes),
                                                                                         dtype=torch.uint8)
        packed = packed.to(self.device)
        parts = [torch.empty_like(packed) for _ in range(self.world)]
        with _collective():
            dist.all_gather(parts, packed)
        return torch.stack(parts).cpu()

    def _votes_of(self, gathered: torch.Tensor, at: int, votes: bytes) -> list[bytes] | None:
        """Rank 0: every rank's votes from the gathered tensor (a rank's over VOTES_BYTES: all ranks gather
        them once more, gather_bytes, alike, as each sees every length); None on the others."""
        lengths = gathered[:, at].tolist()
        if max(lengths) > VOTES_BYTES:
            return self.gather_bytes(votes)
        if not self.leader:
            return None
        return [row[at + 1:].contiguous().view(torch.uint8)[:length].numpy().tobytes()
                for row, length in zip(gathered, lengths)]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's `data` on rank 0 (in rank order), None on the others. Blocking."""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = [torch.zeros_like(length) for _ in range(self.world)]
        with _collective():
            dist.all_gather(lengths, length)
        sizes = [int(size) for size in torch.cat(lengths).tolist()]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(max(sizes), dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        with _collective():
            dist.all_gather(parts, padded.to(self.device))
        if not self.leader:
            return None
        return [part[:size].cpu().numpy().tobytes() for part, size in zip(parts, sizes)]

    def broadcast_bytes(self, data: bytes | None) -> bytes | None:
        """Rank 0's `data` (None included) on every rank. Blocking."""
        length = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=self.device)
        with _collective():
            dist.broadcast(length, src=0)
        size = int(length.item())
        if size < 0:
            return None
        buffer = torch.zeros(size, dtype=torch.uint8)
        if self.leader and size:
            buffer[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buffer = buffer.to(self.device)
        with _collective():
            dist.broadcast(buffer, src=0)
        return buffer.cpu().numpy().tobytes()

    def all_true(self, value: bool) -> bool:
        """Whether `value` holds on every rank. Blocking."""
        flag = torch.tensor([0 if value else 1], dtype=torch.int64, device=self.device)
        with _collective():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not flag.item()


def start(device: str = "cpu", timeout_s: float = 7 * 24 * 3600.0) -> Ranks | None:
    """Join torchrun's process group when this process runs under torchrun (RANK and WORLD_SIZE set),
    with gloo on CPU and nccl on CUDA (each local rank its own GPU); None in a plain process.
    `timeout_s`: how long a collective may wait for a slow rank (a daemon may wait days for records;
    a rank that dies is torchrun's to notice, which stops the others; an agent that dies, the kernel's:
    streamer.cli.rank_process). ValueError (one line) when CUDA is asked for and this local rank has
    no GPU of its own."""
    global _current
    environment = torchrun_environment()
    if environment is None:
        return None
    rank, world, local_rank = environment
    cuda = device in ("cuda", "auto") and torch.cuda.is_available()
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU of its own ({torch.cuda.device_count()} visible): "
                             f"start at most {torch.cuda.device_count()} ranks per machine, or use --device cpu")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    _current = Ranks(rank, world, torch.device("cuda", local_rank) if cuda else torch.device("cpu"))
    return _current


def current() -> Ranks | None:
    """The Ranks `start` joined, or None (one process)."""
    return _current


def stop() -> None:
    """Leave the process group (at the end of a run). The collection after it frees what is left of
    the group (gloo's pairs, held in reference cycles) while the interpreter is whole: left to the
    interpreter's exit, one rank in six aborted there ("terminate called without an active exception")
    after a run that had ended well."""
    global _current
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()
    _current = None


def part(outlast_rank_0_s: float = 0.0) -> None:
    """The end of a run: the ranks wait for each other at a barrier (rank 0 comes once its report is
    written), then leave the group (stop). torchrun's agent stops the other ranks (SIGTERM) as soon as
    one ends with a failure status and names that one as failed: a lost broker's exit status 2, taken
    by a rank while rank 0 still wrote its report, killed rank 0 there, and the launcher blamed a rank
    that had said nothing. Rank 0 says the line (and so should end first): with `outlast_rank_0_s` a
    rank then waits that long, for the agent to stop it once rank 0 has ended (on another machine,
    whose agent does not, it ends after the wait)."""
    try:
        if dist.is_available() and dist.is_initialized():  # (nccl: on this rank's own GPU)
            dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)
    except RuntimeError:  # a rank is gone: its end is torchrun's to report
        pass
    stop()
    time.sleep(outlast_rank_0_s)


def without_source_location(text: str) -> str:
    """An error's text less the C++ source location gloo puts first ("[.../pair.cc:534] Connection ...")."""
    return text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text


def ranks_count() -> int:
    """The ranks of this learner (1 in one process)."""
    return _current.world if _current is not None else 1


def true_on_every_rank(value: bool) -> bool:
    """Whether `value` holds on every rank (one all-reduce, so every rank must ask at the same point);
    `value` itself in one process."""
    return value if _current is None else _current.all_true(value)


@torch.no_grad()
def average_gradients(parameters) -> None:
    """Replace each parameter's gradient by its mean over the ranks (one flattened all-reduce: what
    DistributedDataParallel computes); parameters without a gradient stay without. A no-op in one process."""
    world = ranks_count()
    if world == 1:
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with _collective():
        dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def mean_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s mean over the ranks (a new tensor; `tensor` itself in one process)."""
    world = ranks_count()
    if world == 1:
        return tensor
    total = tensor.detach().clone()
    with _collective():
        dist.all_reduce(total)
    return total / world
