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
  (streamer.threads), so a job pinned to N threads keeps N.
- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``: set by ``torchrun`` (and ``streamer learn --nproc``) for each
  rank of a distributed learner (``torchrun_environment``); torch.distributed itself reads
  ``MASTER_ADDR`` and ``MASTER_PORT``.
- ``GOMP_SPINCOUNT``: written, not read for a decision: the learning commands set it to
  ``500`` before torch loads its OpenMP runtime (GNU libgomp, torch's on Linux) unless the user
  set it or ``OMP_WAIT_POLICY`` (``bound_openmp_spin``): an OpenMP thread with nothing to do
  spins about 5 microseconds, long enough to catch the step's next parallel region, then sleeps.
  libgomp's own default spins about 3 ms, so a second torch job on the same CPUs waits on spinning
  threads; ``OMP_WAIT_POLICY=PASSIVE`` (no spin) made the 2-thread step 1.5x slower.
- ``OMP_WAIT_POLICY``: written as ``ACTIVE`` beside the spin count (ours or the user's) when torch's
  runtime is libgomp and the user did not set it. With a spin count set, ACTIVE changes one thing
  there: libgomp spins 100 times (not the 500) once it manages more threads than CPUs, which it
  does for good as soon as a second thread runs a parallel torch op (the checkpoint's copy on the
  event loop, a resume's load) beside the step's; ACTIVE makes that min(1000, GOMP_SPINCOUNT), the
  same 500. Without it the default LSTM's step went from 9 to 20-26 ms after the first checkpoint
  and stayed there. Not written for LLVM's or Intel's OpenMP runtime (there ACTIVE means spinning
  without end).

Library code receives these values as arguments; only the command line (streamer/cli/) and
this module look at the environment.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["cache_root", "weights_root", "grafana_credentials_environment", "omp_num_threads",
           "bound_openmp_spin", "torch_openmp_is_gnu", "forbid_model_hub", "kafka_client_options",
           "secret_variable", "torchrun_environment"]

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


def torchrun_environment() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process (RANK and WORLD_SIZE set), else None."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    return int(rank), int(world), int(os.environ.get("LOCAL_RANK", rank))


OPENMP_SPINS = 500  # benchmarks/contention.py: 1,000 let two learners fight (2.5-2.9x), 500 did not (1.9-2.2x)


def bound_openmp_spin() -> bool:
    """Set GOMP_SPINCOUNT unless the user set it, and OMP_WAIT_POLICY=ACTIVE beside a spin count (the
    user's too) where torch's OpenMP is libgomp (see above); nothing when the user set OMP_WAIT_POLICY.
    True when this call set the spin count. Only effective before torch (and its OpenMP runtime) is
    imported."""
    if "OMP_WAIT_POLICY" in os.environ:
        return False
    if torch_openmp_is_gnu():  # with a spin count set, ACTIVE only lifts the throttled spin (above)
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    if "GOMP_SPINCOUNT" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPINS)
    return True


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
