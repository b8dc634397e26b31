"""What the learning loop reads from: the `Source` protocol, the records it yields (`Fetched`) and the
one-line error it raises (`SourceError`). streamer.kafka.consumer.KafkaSource is the product's source; a
test's in-memory list is another (tests/test_loop.py's MemorySource). No Kafka client here: the loop
imports this, not aiokafka."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, runtime_checkable

from producers.wire import Record

__all__ = ["Fetched", "Source", "SourceError", "CODEC_CURE"]

# the cure of a codec_missing stop, said by the source that found it and by a rank 0 another rank told
CODEC_CURE = ("install aiokafka's codecs where the learner runs (pip install cramjam), or produce with compression "
              "gzip or none: the same command then continues the run")


class SourceError(RuntimeError):
    """One line for the user. `every_rank`: a decision on the topic or the group that every rank of a
    distributed learner makes alike (not on this rank's own connection): rank 0 says it, the others exit
    quietly with the same status (streamer.cli.learn)."""

    def __init__(self, message: str, *, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


@dataclass(frozen=True)
class Fetched:
    record: Record | None  # None when it cannot be decoded
    tp: tuple[str, int]
    offset: int
    dead_reason: str | None = None
    copy: tuple | None = field(default=None, repr=False)  # then its dead-letter copy (send_dead_letter sends it)
    last: int | None = None  # the last offset of its partition this fetch returns (None: not known)
    # a decoded record's headers as they came (a Kafka source's): its dead-letter copy, if it is refused after
    # decoding (extra_stream), keeps those of the producer's own (a trace id) beside the truth's
    headers: tuple | list | None = field(default=None, repr=False)


@runtime_checkable
class Source(Protocol):
    """What streamer.loop.PrequentialLoop calls. A partition is a (topic, partition) pair; offsets are
    Kafka's (the next record to read is the partition's position).

    Optional, read with getattr where a source has them (KafkaSource has all; a list in memory none):
    - `topic`, `bootstrap_servers`: named in the loop's lines;
    - `topic_missing_since` (wall time or None): start() waits for a topic that does not exist yet, so
      the run's time limit and idle timeout stop it;
    - `reachable()` (async -> bool) and `topic_gone` (bool): whether the broker answers and lists the
      topic; the loop waits a broker that does not (or a deleted topic) out up to --broker-timeout;
    - `log_ends()` (async -> {partition: offset after its last record}): what a caught-up learner compares
      its positions with;
    - `hold(partitions) -> set`: fetch nothing from those partitions until the next call (a stream far
      ahead waits in the log while a batch waits for another stream), the rest again;
    - `take_gaps() -> [(partition, log beginning, records lost)]`: records deleted unread since the last
      call (counted as dead letters, deleted_before_read; there is no record to send);
    - `refusal` (str or None): a line after which nothing more is read (the log is not the checkpoint's, or
      its records cannot be decompressed here), and `refusal_reason`, the stop's reason (log_changed,
      codec_missing);
    - `dead_letter_failures` (int): dead-letter sends that failed;
    - `settle_dead_letters()` (async): the dead-letter copies in flight delivered, or counted as failed."""

    async def start(self) -> None:
        """Connect and take the partitions; SourceError (one line) when it cannot."""

    async def stop(self) -> None:
        """Let go of the partitions and connections; never held up long by a broker that is away."""

    def fetch(self, *, max_records: int | None = None) -> AsyncIterator[Fetched]:
        """The records of one read (an async generator), at most `max_records`, in offset order per
        partition; one that cannot be decoded comes with `record` None and its `dead_reason`."""

    def seek(self, tp: tuple[str, int], offset: int) -> None:
        """Read partition `tp` from `offset` at the next fetch."""

    async def send_dead_letter(self, fetched: Fetched, reason: str, detail: str) -> None:
        """Keep a record the learner cannot learn, with its reason; a failure is counted, never raised."""

    async def commit(self, offsets: dict) -> bool | None:
        """Commit {partition: next offset} (only after the checkpoint holding them is written)."""

    async def lag(self, taken: dict | None = None, read: dict | None = None) -> dict[int, int]:
        """{partition number: records in the log not yet read}. `taken`: the learner's next offset per
        partition, for records fetched but not yet taken (counted as lag); `read`: how far it has read,
        a floor (records before it, read again after a rewind, are no lag)."""
