"""Group-less reads of topics: topic and partition listing, high-water marks, fixed ranges and following partitions.

Consumes: a raw consumer client with no group (kafka-python's ``KafkaConsumer``, or the in-process bus's
``MemoryConsumer``), built by :meth:`~stream_rl.transport.client.Transport.reader`.
Produces: a :class:`Reader`, which speaks plain ``(topic, partition)`` pairs and hands out :class:`Record` (or, for
an offset of a batch the client cannot read, :class:`~stream_rl.transport.unreadable.SkippedRecord`): business
code never holds a client, a kafka-python partition or a kafka-python record.
Guarantees:
- Nothing is ever committed (no group); nothing a reader does moves any group's position.
- High-water marks come from fetch responses, not from ListOffsets(latest), which is wrong on tansu 0.6: each
  partition is fetched (from the beginning, or from a given offset) until the response names its mark.
- A topic that does not exist raises ``KeyError`` naming it (after ``timeout_s``: metadata may lag a creation).
- ``read_range`` and ``highwaters`` assign the reader's client to the partitions they read: a reader that follows
  partitions (:meth:`Reader.follow`, :meth:`Reader.poll`) takes its measurements with a second reader.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from stream_rl.transport.tracing import Headers
from stream_rl.transport.unreadable import SkippedRecord, find_unreadable

Partition = tuple[str, int]
"""A partition as ``(topic, partition)``."""


@dataclass(frozen=True)
class Record:
    """One record as the broker holds it (value undecoded) and where it lies."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers = field(default_factory=list)
    timestamp_ms: int = -1

    @classmethod
    def of(cls, rec: Any) -> Record:
        """The record of a client's fetched record (kafka-python's ``ConsumerRecord`` or the bus's)."""
        return cls(rec.topic, rec.partition, rec.offset, rec.key, rec.value, list(rec.headers or ()), rec.timestamp)


def topic_partition(key: Any):
    """kafka-python's partition type of a ``(topic, partition)`` pair (a named tuple: equal to, and hashed like,
    the plain pair); the one conversion the transport's clients are handed (the bus's clients take it too)."""
    from kafka.structs import TopicPartition

    return key if isinstance(key, TopicPartition) else TopicPartition(*key)


def _seek_each(consumer: Any, offsets: Mapping[Any, int | None]) -> None:
    """Seek each assigned partition to its offset (None or < 0: its first record)."""
    for key, offset in offsets.items():
        if offset is None or offset < 0:
            consumer.seek_to_beginning(topic_partition(key))
        else:
            consumer.seek(topic_partition(key), offset)


def list_partitions(consumer: Any, topic: str, timeout_s: float = 10.0) -> list[Partition]:
    """Every partition of ``topic`` known to ``consumer`` (a raw client); KeyError naming the topic when it does
    not exist within ``timeout_s`` (asked at least once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return [(topic, p) for p in sorted(parts)]
        if time.monotonic() >= deadline:
            raise KeyError(f"topic {topic} does not exist")
        time.sleep(0.1)


class Reader:
    """A consumer with no group: it never commits and reads whatever it is told to (module docstring)."""

    def __init__(self, consumer: Any):
        self._consumer = consumer

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what exists -----------------------------------------------------------------------------------------------

    def topics(self) -> set[str]:
        """Names of every topic on the cluster (or bus)."""
        return set(self._consumer.topics())

    def partitions(self, topic: str, timeout_s: float = 10.0) -> list[Partition]:
        """Every partition of ``topic`` in order; KeyError naming it when it does not exist within ``timeout_s``
        (``0``: asked once, no wait)."""
        return list_partitions(self._consumer, topic, timeout_s)

    # -- measurements ----------------------------------------------------------------------------------------------

    def highwaters(self, partitions: Iterable[Partition], timeout_s: float = 10.0,
                   start: Mapping[Partition, int | None] | None = None) -> dict[Partition, int]:
        """High-water mark of each partition, taken from fetch responses (ListOffsets(latest) is wrong on tansu).

        Each partition is fetched from ``start[partition]`` when given and >= 0 (e.g. the previous mark, so a
        repeated measurement moves only the records added since), else from the beginning; nothing is consumed.
        TimeoutError naming the partitions that got no fetch response within ``timeout_s``."""
        consumer = self._consumer
        tps = [topic_partition(key) for key in partitions]
        start = {topic_partition(key): offset for key, offset in (start or {}).items()}
        consumer.assign(list(tps))
        _seek_each(consumer, {tp: start.get(tp) for tp in tps})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            consumer.poll(timeout_ms=200, max_records=1, update_offsets=False)
            marks = {tp: consumer.highwater(tp) for tp in tps}
            if all(v is not None for v in marks.values()):
                return {(tp.topic, tp.partition): int(mark) for tp, mark in marks.items()}
        missing = [f"{tp.topic}[{tp.partition}]" for tp in tps if consumer.highwater(tp) is None]
        raise TimeoutError(f"no fetch response within {timeout_s}s for {', '.join(missing)}")

    # -- a fixed range ---------------------------------------------------------------------------------------------

    def read_range(self, partition: Partition, start: int, limit: int | None,
                   timeout_s: float = 10.0) -> Iterator[Record | SkippedRecord]:
        """Records of one partition from ``start`` up to its high-water mark when the read began (or ``limit``
        records). TimeoutError when no record came for ``timeout_s``.

        A batch the client cannot read (codec, corruption) comes out as one :class:`SkippedRecord` per offset with
        the reason, and the read goes on after it."""
        consumer = self._consumer
        tp = topic_partition(partition)
        end = self.highwaters([partition], timeout_s)[(tp.topic, tp.partition)]
        consumer.assign([tp])
        consumer.seek(tp, max(start, 0))
        produced = 0
        deadline = time.monotonic() + timeout_s
        while consumer.position(tp) < end and (limit is None or produced < limit):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tp.topic}[{tp.partition}] stalled at offset {consumer.position(tp)} of {end}")
            try:
                fetched = [Record.of(rec) for rec in consumer.poll(timeout_ms=500).get(tp, [])]
            except Exception as exc:  # only an unreadable batch is reported and skipped; anything else propagates
                where = find_unreadable(consumer, exc)
                if where is None:
                    raise
                consumer.seek(tp, where.last + 1)
                fetched = SkippedRecord.each(where)
            for rec in fetched:
                if limit is not None and produced >= limit:
                    return
                produced += 1
                deadline = time.monotonic() + timeout_s
                yield rec

    # -- following partitions --------------------------------------------------------------------------------------

    def follow(self, offsets: Mapping[Partition, int | None]) -> None:
        """Read exactly these partitions from now on, each from its offset (None or < 0: its first record)."""
        self._consumer.assign([topic_partition(key) for key in offsets])
        _seek_each(self._consumer, offsets)

    def poll(self, timeout_s: float = 0.0, max_records: int | None = None) -> list[Record]:
        """The next records of the followed partitions (waits at most ``timeout_s`` for some), partition by
        partition."""
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        return [Record.of(rec) for records in batches.values() for rec in records]

    def position(self, topic: str, partition: int) -> int:
        """The offset of the next record :meth:`poll` hands out from a followed partition."""
        return self._consumer.position(topic_partition((topic, partition)))

    def highwater(self, topic: str, partition: int) -> int | None:
        """A followed partition's high-water mark as of the last fetch (None before one; no request)."""
        mark = self._consumer.highwater(topic_partition((topic, partition)))
        return None if mark is None else int(mark)

    def close(self) -> None:
        self._consumer.close()
