"""The one module that reads environment variables. Each one, and what it changes:

- ``STREAMER_CACHE``: the cache directory for built corpora and weights (weights go to its
  ``models/`` folder). Default ``$XDG_CACHE_HOME/streamer``, else ``~/.cache/streamer``.
- ``XDG_CACHE_HOME``: the base of the default cache directory (an absolute path, per the XDG spec).
- ``HF_HUB_OFFLINE``: when true (1, true, yes, on), ``--model-opt name=HUB_ID`` never tries the hub.
- ``HTTPS_PROXY`` / ``https_proxy`` / ``ALL_PROXY`` / ``all_proxy``: a proxy is set, so only the
  proxy knows whether the hub is reachable.
- ``GRAFANA_TOKEN``, or ``GRAFANA_USER`` and ``GRAFANA_PASSWORD``: credentials of
  ``streamer monitor push`` (never a flag, so they do not show in ``ps``).
- ``OMP_NUM_THREADS``: when set to a positive integer, the default of ``--threads``
  (streamer.threads), so a job pinned to N threads keeps N.
- ``OMP_WAIT_POLICY``: written, not read for a decision: the learning commands set it to
  ``PASSIVE`` before torch loads its OpenMP runtime, unless the user set it
  (``prefer_passive_openmp``), so idle OpenMP threads sleep instead of spinning.

Library code receives these values as arguments; only the command line (streamer/cli/) and
this module look at the environment.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root", "weights_root", "hub_offline", "behind_proxy", "grafana_credentials_environment",
           "omp_num_threads", "prefer_passive_openmp"]

_TRUE = ("1", "true", "yes", "on")
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


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


def behind_proxy() -> bool:
    return any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))


def grafana_credentials_environment() -> dict[str, str]:
    """The Grafana credential variables that are set (GRAFANA_TOKEN, GRAFANA_USER, GRAFANA_PASSWORD)."""
    return {name: os.environ[name] for name in GRAFANA_VARIABLES if os.environ.get(name)}


def omp_num_threads() -> int | None:
    """$OMP_NUM_THREADS as a positive integer, else None (unset or not a positive integer)."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def prefer_passive_openmp() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless the user set it; True when this call set it.

    Only effective before torch (and its OpenMP runtime) is imported."""
    if "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
