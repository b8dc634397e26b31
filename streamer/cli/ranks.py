"""What a rank of a distributed `streamer learn` decides on its own: its share of the CPUs (--pin-cpus),
whether the run can be one model across ranks (one line, said by rank 0), how it ends on rank 0's line or
another rank's loss, and its exit status."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import NoReturn

from streamer.cli.errors import UserError
from streamer.config import LearnConfig
from streamer.settings import started_by_torchrun_agent, torchrun_environment, torchrun_local_world
from streamer.threads import available_cpus, pin_to_rank_share

__all__ = ["NOT_DISTRIBUTED", "pin_rank", "a_peer_is_gone", "last_words", "rank_status", "refusal", "refuse_for_ranks",
           "refuse", "leave_the_line_to_rank_0"]


def pin_rank(args) -> str | None:
    """--pin-cpus under torchrun: pin this rank to its share of the CPUs (before torch loads and the
    thread policy is decided); the line that says so, or None without --pin-cpus or torchrun."""
    environment = torchrun_environment()
    if not getattr(args, "pin_cpus", False) or environment is None:
        return None
    local_rank, local_world = environment[2], torchrun_local_world()
    if local_world is None:
        return "CPUs not pinned: LOCAL_WORLD_SIZE is not set (torchrun sets it in every rank; --pin-cpus)"
    if not 0 <= local_rank < local_world:
        return f"CPUs not pinned: local rank {local_rank} is not below LOCAL_WORLD_SIZE {local_world} (--pin-cpus)"
    share = pin_to_rank_share(local_rank, local_world)
    if share is None:
        return (f"CPUs not pinned: {available_cpus()} CPUs for {local_world} ranks on this machine, "
                f"fewer than one each (--pin-cpus)")
    return f"CPUs {_cpu_list(share)}: local rank {local_rank}'s share of {local_world} (--pin-cpus)"


def _cpu_list(cpus: list[int]) -> str:
    """0-7 for consecutive CPUs, else 0,2,5."""
    if len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def a_peer_is_gone(exc: RuntimeError) -> bool:
    """Whether a collective failed because another rank died: torch.distributed's own errors, or gloo's
    transport (a RuntimeError naming gloo/transport: 'Connection closed by peer')."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or "gloo/transport" in str(exc)


def last_words(exc: Exception) -> str:
    """The error's first line, less the C++ source location gloo puts before it."""
    from streamer.distributed import without_source_location

    return without_source_location(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


def rank_status(stop_reason: str) -> int:
    """The exit status every rank of a distributed run ends with (they all stop at the same step, with
    the same reason): 0 for a run that ended as asked (the stream, --max-batches, --idle-timeout,
    --minutes), 2 for a lost broker, a log not the learner's (log_changed) or records it cannot decompress
    (codec_missing; rank 0 says the line), 143 for
    a stop by a signal, whichever rank received it. torchrun's agent waits up to 5 minutes at its exit
    barrier for the other machines' agents when its ranks exit 0, and returns at once when they fail: so a
    machine whose agent was killed (its ranks stopped by the parent-death signal, the others by the per-step
    agreement) does not keep the other machines waiting, and under `Restart=on-failure` they start again."""
    if stop_reason in ("broker_lost", "log_changed", "codec_missing"):
        return 2
    return 128 + signal.SIGTERM if stop_reason == "signal" else 0


# Strategies whose state changes the model's shape or routing by what one rank sees: they cannot be
# one model across ranks.
NOT_DISTRIBUTED = {
    "adapters": "adds an adapter set per distribution its detector finds, which differs between ranks",
    "independent": "routes each batch to one model per ground-truth class, which differs between ranks' rows",
}


def refusal(config: LearnConfig, world: int, stream: bool = True) -> str | None:
    """Why `config` cannot run as `world` ranks (one line), or None; with `stream` False, not asked of its
    streams (another rank than rank 0, whose stream is every rank's)."""
    if stream and config.streams % world:
        return (f"--streams {config.streams} is not divisible by {world} ranks (each rank learns streams / ranks "
                f"of them); use a multiple of {world}")
    if config.strategy in NOT_DISTRIBUTED:
        return f"strategy {config.strategy} {NOT_DISTRIBUTED[config.strategy]}: run it in one process"
    if config.model_name == "hf-classifier":
        return "the classifier's utterance batches are not split across ranks yet: run it in one process"
    return None


def refuse_for_ranks(config: LearnConfig, world: int, leader: bool, stream: bool = True) -> None:
    """Rank 0 says why in one line (UserError), and so does a rank on another machine (`stream` False: not
    asked of the streams, rank 0's, which it learns by; its command line is its host's own); the other
    ranks on rank 0's machine refuse alike and leave the line to rank 0."""
    reason = refusal(config, world, stream=stream)
    if reason is not None:
        refuse(UserError(reason), leader, beside_rank_0=stream)


def refuse(error: UserError, leader: bool, beside_rank_0: bool, wait_s: float = 10.0) -> NoReturn:
    """Refuse the run before the process group: `error` is raised (one line) by rank 0, by one process,
    by a rank on another machine (its command line is its host's own) and by a rank that torchrun's
    agent did not start. A rank of the agent on rank 0's machine refuses alike and leaves the line to
    rank 0: it waits (up to `wait_s`, then ends 2) for the SIGTERM that the agent sends once rank 0
    has ended, and ends as stopped by it (143: the agent's summary names rank 0 alone as failed).
    Ending first, it made the agent stop rank 0 before rank 0 said its line (1 of 8 tries gave no line
    at all), where each rank had said it."""
    if leader or not beside_rank_0 or not started_by_torchrun_agent():
        raise error
    leave_the_line_to_rank_0(wait_s)


def leave_the_line_to_rank_0(wait_s: float = 10.0) -> NoReturn:
    """A rank other than 0 whose run ends on rank 0's one line (a refusal, a source every rank lost): it
    waits, up to `wait_s`, for the SIGTERM torchrun's agent sends once rank 0 has ended, and ends by it;
    else with 2. Ending first with 2, it was the rank the launcher named as failed (2 of 5 tries of a
    1-rank checkpoint resumed with --nproc 2), though it had said nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    environment = torchrun_environment()
    beside_rank_0 = environment is not None and torchrun_local_world() == environment[1]  # one machine: its agent
    if started_by_torchrun_agent() and beside_rank_0:  # stops this rank once rank 0 ends (another host's may not)
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))  # not "SIGTERM before ..."
        time.sleep(wait_s)
    raise SystemExit(2)
