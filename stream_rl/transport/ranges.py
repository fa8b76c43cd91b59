"""Reading a fixed range of one topic with a consumer group's commits: one-off jobs over the durable log
(``stream-rl rescore``).

Consumes: a topic, a ``[start, end)`` offset range per partition, a consumer group id, a :class:`Sink`.
Produces: :class:`BoundedSource`, whose ``poll`` hands out decoded, validated records (the edge's
:class:`~stream_rl.transport.edge.Source`: invalid records dead-lettered with their reason and source offset) with
offsets inside the ranges; and the measurements a job plans its ranges from: whether a topic exists, its
high-water marks, a group's committed offsets.

Guarantees:
- The partitions are assigned, not subscribed: no group join and no rebalance, so the range read is exactly the
  one asked for. The group is used for commits only (an OffsetCommit without a generation, which Apache Kafka and
  the local broker accept from a consumer that assigns its partitions itself).
- No record at or past its partition's end is handed out; a partition that reached its end is held paused.
  A record past the end fetched in the same batch is dropped, not scored, and not committed (one that fails to
  decode is still dead-lettered by the edge, which sees it first).
- ``commit`` commits ``min(position, end)`` per partition, and only once the sink holds no unacknowledged send
  (the edge's rule), so a job killed mid-way continues from its group's commits and loses nothing.
- ``poll`` raises :class:`RangeStalled` naming the partition when no partition moved for ``stall_s`` while some
  have not reached their end; a lost broker raises ``BrokerUnreachable`` first (``kafka.broker_timeout_s``).
  A commit the broker refuses (the group has active members of its own) raises :class:`RangeError`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kafka import TopicPartition

from stream_rl.transport.client import Transport
from stream_rl.transport.edge import Consumed, Sink, Source
from stream_rl.transport.settings import ClientProbe


class RangeError(RuntimeError):
    """A bounded read that cannot go on (the message says why)."""


class RangeStalled(RangeError):
    """A partition stopped short of its end offset: the records between are not being delivered."""


def topic_exists(transport: Transport, topic: str) -> bool:
    with transport.admin() as admin:
        return topic in admin.list_topics()


def end_offsets(transport: Transport, topic: str) -> dict[int, int]:
    """``{partition: high-water mark}`` of an existing ``topic`` now (from fetch responses, see
    :meth:`~stream_rl.transport.reader.Reader.highwaters`)."""
    with transport.reader() as reader:
        return {partition: mark for (_, partition), mark in reader.highwaters(reader.partitions(topic)).items()}


def group_commits(transport: Transport, group: str, topic: str) -> dict[int, int]:
    """``{partition: offset}`` that ``group`` committed on ``topic`` (partitions without a commit left out)."""
    with transport.admin() as admin:
        found = admin.committed_offsets(group)
    return {partition: offset for (name, partition), offset in found.items() if name == topic}


class BoundedSource:
    """The records of ``topic`` in ``[start, end)`` per partition, committed as ``group`` (module docstring)."""

    def __init__(self, source: Source, topic: str, ranges: Mapping[int, tuple[int, int]], group: str,
                 stall_s: float):
        self.source = source
        self.group = group
        self.topic = topic
        self.ranges = {TopicPartition(topic, p): bounds for p, bounds in ranges.items()}
        self.stall_s = stall_s
        self.read = 0
        """Offsets consumed inside the ranges: records handed out plus records the edge dead-lettered."""
        self._positions = {tp: start for tp, (start, _) in self.ranges.items()}
        self._moved = time.monotonic()

    @classmethod
    def open(cls, transport: Transport, topic: str, ranges: Mapping[int, tuple[int, int]], group: str,
             expected_kind: str, sink: Sink, dlq_topic: str, *, keep_rejections: bool = False) -> BoundedSource:
        """Assign ``topic``'s partitions in ``ranges``, each positioned at its start; invalid records go to
        ``dlq_topic`` through ``sink`` (``keep_rejections``: see :class:`~stream_rl.transport.edge.Source`)."""
        kafka, probe = transport.cfg.kafka, ClientProbe()
        consumer = transport.consumer(group, probe)
        source = Source(consumer, sink, dlq_topic, expected_kind, transport.instance_id, transport.tracing,
                        probe=probe if transport.bus is None else None, broker_timeout_s=kafka.broker_timeout_s, bootstrap=transport.bootstrap,
                        keep_rejections=keep_rejections)
        bounded = cls(source, topic, ranges, group, kafka.broker_timeout_s)
        consumer.assign(list(bounded.ranges))
        for tp, (start, _) in bounded.ranges.items():
            consumer.seek(tp, start)
        source.holds = bounded._finished()
        return bounded

    @property
    def done(self) -> bool:
        return not any(self._positions[tp] < end for tp, (_, end) in self.ranges.items())

    def positions(self) -> dict[int, int]:
        """``{partition: next offset to read}`` (at most the partition's end)."""
        return {tp.partition: min(pos, self.ranges[tp][1]) for tp, pos in self._positions.items()}

    def poll(self, timeout_s: float, max_records: int) -> list[Consumed]:
        """The next valid records inside the ranges (possibly none); raises RangeStalled (module docstring)."""
        dead_before = self.source.dead_lettered
        records = self.source.poll(timeout_s, max_records=max_records)
        inside = [r for r in records if r.offset < self.ranges[TopicPartition(r.topic, r.partition)][1]]
        before = dict(self._positions)
        for tp in self.ranges:
            self._positions[tp] = max(self._positions[tp], self.source.position(*tp))
        self.read += len(inside) + self.source.dead_lettered - dead_before
        self.source.holds = self._finished()
        if self._positions != before or self.done:
            self._moved = time.monotonic()
        elif time.monotonic() - self._moved > self.stall_s:
            raise RangeStalled(self._stall_message())
        return inside

    def commit(self) -> None:
        """Commit each partition's position, capped at its end (after ``sink.flush()``)."""
        if not self.source.commit({tp: min(pos, self.ranges[tp][1]) for tp, pos in self._positions.items()}):
            raise RangeError(f"the broker refused a commit in group {self.group}: a group with active members "
                             f"takes commits from its members only; use a group of this job's own")

    def close(self) -> None:
        self.source.close()

    def _finished(self) -> set[TopicPartition]:
        return {tp for tp, (_, end) in self.ranges.items() if self._positions[tp] >= end}

    def _stall_message(self) -> str:
        short = [f"{tp.topic}[{tp.partition}] at {self._positions[tp]} of {end}"
                 for tp, (_, end) in self.ranges.items() if self._positions[tp] < end]
        return f"no record delivered for {self.stall_s:g}s (kafka.broker_timeout_s): {', '.join(short)}"
