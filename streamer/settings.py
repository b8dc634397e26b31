"""The one module that reads environment variables. Each one, and what it changes:

- ``STREAMER_CACHE``: the cache directory for built corpora and weights (weights go to its
  ``models/`` folder). Default ``$XDG_CACHE_HOME/streamer``, else ``~/.cache/streamer``.
- ``XDG_CACHE_HOME``: the base of the default cache directory (an absolute path, per the XDG spec).
- ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``: written, not read for a decision: the learning
  commands set both to ``1`` before transformers is imported (``forbid_model_hub``), so no model
  file is ever fetched from a hub; weights come from `streamer weights build` or local paths.
- ``STREAMER_KAFKA_PASSWORD`` or the variable ``--sasl-password-env`` names: the Kafka SASL
  password (``kafka_client_options``); never a flag value, so it does not show in ``ps``.
- ``GRAFANA_TOKEN``, or ``GRAFANA_USER`` and ``GRAFANA_PASSWORD``: credentials of
  ``streamer monitor push`` (never a flag, so they do not show in ``ps``).
- ``OMP_NUM_THREADS``: when set to a positive integer, the default of ``--threads``
  (streamer.threads), so a job pinned to N threads keeps N. Written by ``learn --nproc`` where the
  user has not set it (``set_rank_threads``): the ranks' own thread count, passed on by torchrun,
  which would otherwise set 1 and say so in a four-line warning.
- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``: set by ``torchrun`` (and ``streamer learn --nproc``) for each
  rank of a distributed learner (``torchrun_environment``); torch.distributed itself reads
  ``MASTER_ADDR`` and ``MASTER_PORT``. ``LOCAL_WORLD_SIZE`` (torchrun's ranks on this machine) sizes
  each rank's share of the CPUs under ``learn --pin-cpus`` (``torchrun_local_world``).
  ``TORCHELASTIC_RUN_ID``, set by torchrun's elastic agent in the ranks it starts
  (``started_by_torchrun_agent``): such a rank ends with its agent (streamer.cli.rank_process).
- ``STREAMER_AGENT_PID``: written by ``learn --nproc`` (``set_agent_pid``), whose own process is
  torchrun's agent, for the ranks it starts; a rank whose parent is another process by the time it
  asks for its agent's death signal (``agent_pid``) was orphaned before it could ask, and stops.
- ``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``: written before torch loads its OpenMP runtime, unless
  the user set either (``choose_openmp_spin``, called by the command line once it knows the torch
  threads). With GNU libgomp (torch's on Linux), /proc/stat to watch the CPUs by, and a second
  team that takes libgomp over the CPU count (libgomp counts 2 x threads - 1 threads for two
  teams: the default policy on 2 CPUs and on 4 or more, not on 3):
  ``GOMP_SPINCOUNT=300000``, libgomp's own long spin (about 3 ms: the step's helpers catch its
  next parallel region; with 2,000 they fell asleep between regions, and the memory path ran at
  0.93 of torch's default on 2 cores, 0.68 on 16), and ``OMP_WAIT_POLICY`` left unset, so that
  streamer.spin can shorten every spin to libgomp's throttled 100 turns while other work shares
  the CPUs; ``STREAMER_OPENMP_SPIN=governed`` beside it tells the processes this one starts
  (compare's jobs, a learner started from it) that the spin count is the command's, not the
  user's. Otherwise a fixed short spin: ``GOMP_SPINCOUNT=500`` (or the user's) with
  ``OMP_WAIT_POLICY=ACTIVE`` beside it on libgomp, which keeps the 500 where libgomp would throttle
  them to 100 once a second thread has run a parallel op. libgomp's own default (about 3 ms),
  ungoverned, lets two learners on the same 2 CPUs slow each other 300x; ``OMP_WAIT_POLICY=PASSIVE``
  (no spin) made the 2-thread step 1.5x slower.

Library code receives these values as arguments; only the command line (streamer/cli/) and
this module look at the environment.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["cache_root", "weights_root", "grafana_credentials_environment", "omp_num_threads",
           "choose_openmp_spin", "torch_openmp_is_gnu", "forbid_model_hub", "kafka_client_options",
           "secret_variable", "torchrun_environment", "torchrun_local_world", "set_rank_threads",
           "started_by_torchrun_agent", "set_agent_pid", "agent_pid"]

GRAFANA_VARIABLES = ("GRAFANA_TOKEN", "GRAFANA_USER", "GRAFANA_PASSWORD")


def cache_root() -> Path:
    """$STREAMER_CACHE, else $XDG_CACHE_HOME/streamer, else ~/.cache/streamer."""
    explicit = os.environ.get("STREAMER_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "streamer"


def weights_root() -> Path:
    """<cache_root()>/models: built pretrained weights."""
    return cache_root() / "models"


def grafana_credentials_environment() -> dict[str, str]:
    """The Grafana credential variables that are set (GRAFANA_TOKEN, GRAFANA_USER, GRAFANA_PASSWORD)."""
    return {name: os.environ[name] for name in GRAFANA_VARIABLES if os.environ.get(name)}


def omp_num_threads() -> int | None:
    """$OMP_NUM_THREADS as a positive integer, else None (unset or not a positive integer)."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def set_rank_threads(threads: int) -> None:
    """OMP_NUM_THREADS=`threads` for the ranks torchrun starts from this process, where the user has
    not set it (torchrun then keeps it: no default of 1, no warning)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def set_agent_pid(pid: int) -> None:
    """STREAMER_AGENT_PID=`pid` for the ranks torchrun's agent in this process (`pid`) starts."""
    os.environ["STREAMER_AGENT_PID"] = str(pid)


def agent_pid() -> int | None:
    """The pid of the agent that started this rank, where `learn --nproc` said it; None otherwise."""
    text = os.environ.get("STREAMER_AGENT_PID", "").strip()
    return int(text) if text.isdigit() else None


def torchrun_environment() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process (RANK and WORLD_SIZE set), else None."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    return int(rank), int(world), int(os.environ.get("LOCAL_RANK", rank))


def started_by_torchrun_agent() -> bool:
    """Whether torchrun's elastic agent started this process (TORCHELASTIC_RUN_ID set), so that its
    parent is the agent (RANK and WORLD_SIZE alone may come from elsewhere)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def torchrun_local_world() -> int | None:
    """LOCAL_WORLD_SIZE: the ranks torchrun started on this machine; None outside torchrun."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else None


GOVERNED_SPINS = 300_000  # libgomp's own; streamer.spin shortens them while shared (benchmarks/contention.py)
FIXED_SPINS = 500  # where no governor acts: 1,000 let two learners on 2 CPUs slow each other 2.5-3.9x


def choose_openmp_spin(threads: int, cpus: int, watchable: bool) -> bool:
    """Set OpenMP's wait for `threads` torch threads on `cpus` CPUs (see above; `watchable`:
    streamer.spin.watchable, whether /proc/stat shows them); True when streamer.spin should govern
    it. Nothing when the user set OMP_WAIT_POLICY; the user's GOMP_SPINCOUNT is kept (with ACTIVE
    beside it). Only effective before torch (and its OpenMP runtime) is imported."""
    if "OMP_WAIT_POLICY" in os.environ:
        return False
    gnu = torch_openmp_is_gnu()
    ours = "GOMP_SPINCOUNT" not in os.environ or os.environ.get("STREAMER_OPENMP_SPIN") == "governed"
    if ours and gnu and watchable and 1 < threads and cpus < 2 * threads - 1:
        os.environ["GOMP_SPINCOUNT"] = str(GOVERNED_SPINS)
        os.environ["STREAMER_OPENMP_SPIN"] = "governed"
        return True
    os.environ.pop("STREAMER_OPENMP_SPIN", None)
    if gnu:
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    if ours:
        os.environ["GOMP_SPINCOUNT"] = str(FIXED_SPINS)
    return False


def torch_openmp_is_gnu() -> bool:
    """Whether the torch installed here runs GNU libgomp (Linux wheels ship it in torch/lib; Debian's
    torch links the system's), told without importing torch: not where LLVM's libomp or Intel's libiomp5
    sits beside torch or in this environment's lib/ (macOS wheels, conda's builds)."""
    if not sys.platform.startswith("linux"):
        return False
    spec = importlib.util.find_spec("torch")  # a top-level name: finding it imports nothing
    places = [Path(sys.prefix) / "lib"]
    if spec is not None and spec.submodule_search_locations:
        places += [Path(location) / "lib" for location in spec.submodule_search_locations]
    return not any(any(place.glob(pattern)) for place in places for pattern in ("libomp.*", "libiomp5*"))


def forbid_model_hub() -> None:
    """HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1: transformers and huggingface_hub never reach a hub.

    Called by the learning commands before transformers is imported (it reads them at import)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def secret_variable(name: str) -> str | None:
    """The value of the environment variable `name` (a secret: never logged), or None when unset."""
    return os.environ.get(name) or None


def kafka_client_options(security) -> dict:
    """aiokafka keyword arguments of a producers.security.KafkaSecurity (None: plaintext, no options),
    with the SASL password read from its environment variable or file. One-line ValueError when absent."""
    if security is None:
        return {}
    password = None
    if security.sasl:
        if security.password_env:
            password = secret_variable(security.password_env)
            if password is None:
                raise ValueError(f"the Kafka SASL password variable {security.password_env} is not set")
        else:
            from producers.security import read_password_file

            password = read_password_file(security.password_file)
    return security.client_kwargs(password)
