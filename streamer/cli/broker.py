"""`streamer broker`: the embedded Kafka-compatible broker in the foreground."""

from __future__ import annotations

import time

from streamer.broker import BrokerError, EmbeddedBroker
from streamer.cli.flags import default_of
from streamer.cli.runs import sigterm_as_interrupt

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("broker", help="run the embedded Kafka-compatible broker in the foreground",
                       description="The embedded Tansu broker on a loopback port: plaintext and without "
                                   "authentication (Tansu 0.6.0 offers no usable TLS or SASL; SECURITY.md says why).")
    p.add_argument("--port", type=int, default=default_of(EmbeddedBroker, "port"),
                   help="loopback port (default: a free one)")


def run(args) -> int:
    sigterm_as_interrupt()
    with EmbeddedBroker(port=args.port) as broker:
        print(f"broker listening on {broker.bootstrap_servers} (pid {broker.pid}); Ctrl-C stops it", flush=True)
        while broker.running:
            time.sleep(0.5)
        raise BrokerError(f"the broker on {broker.bootstrap_servers} exited unexpectedly")
