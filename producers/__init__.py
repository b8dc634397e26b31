"""Producers: turn corpora into Kafka streams of wire records (imports nothing from streamer/ or monitor/)."""

from producers.wire import Record, Truth, WireError, decode, encode

__all__ = ["Record", "Truth", "WireError", "decode", "encode"]
