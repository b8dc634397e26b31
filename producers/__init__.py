"""Producers: turn corpora into Kafka streams of wire records."""

__all__ = []
