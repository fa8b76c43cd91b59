"""The transport edge: typed sends and typed, validated, dead-lettering receives with manual commits.

Consumes: kafka-python producers/consumers built from :mod:`stream_rl.transport.settings`, schema messages.
Produces: records on topics (value = ``schemas.encode(msg)``, key as given, W3C trace headers), and
:class:`Consumed` items (decoded, validated messages with their topic/partition/offset/headers).
Guarantees (the delivery contract every role loop relies on)::

    poll() ──> [records] ──> caller's pure step ──> sink.send(outputs) ──> sink.flush() ──> source.commit()
                  │                                                          (broker acked)   (last_offset + 1)
                  └─ undecodable / invalid ──> sink.send(DLQ, DeadLetter(reason, source offset, raw bytes))

- A record that fails to decode or validate is sent to the run's dead-letter topic with the reason and the
  source topic/partition/offset and raw bytes, and the consumer moves on; it is committed with the good ones.
- ``commit`` refuses to run while the sink holds unacknowledged sends, so an offset is never committed before
  the outputs derived from it (and the dead letters) are durable on the broker.
- ``paused`` (set by the loop while an alert with action ``pause`` fires) pauses every assigned partition, so
  ``poll`` returns nothing while the consumer stays in its group; clearing it resumes them.
- An ``observer`` (the role's telemetry) is told of every record fetched, sent and dead-lettered.
- A commit that loses a rebalance race is not an error: the records are redelivered to the partition's new
  owner (at-least-once), and consumers downstream drop duplicates by record id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import DeadLetter, SchemaError, decode, encode
from stream_rl.tracing import Headers, Tracing
from stream_rl.tracing_attrs import span_attributes

log = logging.getLogger(__name__)


class DeliveryError(RuntimeError):
    """The broker did not acknowledge a send; nothing derived from it may be committed."""


@dataclass(frozen=True)
class Consumed:
    """One decoded, validated record and where it came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: Any
    headers: Headers
    timestamp_ms: int
    raw_value: bytes | None = field(default=None, repr=False, compare=False)  # for dead letters downstream


def _key_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


class Sink:
    """Sends messages and knows which sends the broker has not acknowledged yet."""

    def __init__(self, producer, tracing: Tracing):
        self._producer = producer
        self._tracing = tracing
        self._pending: list[tuple[str, Any]] = []
        self.observer = None  # telemetry (records_out); set by RoleTelemetry.attach

    @property
    def pending(self) -> int:
        return len(self._pending)

    def send(self, topic: str, message: Any, key: str | bytes | None = None, headers: Headers | None = None,
             partition: int | None = None, attributes: dict[str, Any] | None = None) -> None:
        """Validate and encode ``message`` (raises SchemaError on an invalid one), then send it."""
        self.send_raw(topic, encode(message), key, headers, partition,
                      {"stream_rl.kind": getattr(message, "KIND", "?"), **span_attributes(message),
                       **(attributes or {})})

    def send_raw(self, topic: str, value: bytes, key: str | bytes | None = None, headers: Headers | None = None,
                 partition: int | None = None, attributes: dict[str, Any] | None = None) -> None:
        with self._tracing.send_span(topic, _key_bytes(key), list(headers or []), attributes) as hdrs:
            future = self._producer.send(topic, value=value, key=_key_bytes(key), headers=hdrs,
                                         partition=partition)
        self._pending.append((topic, future))
        if self.observer is not None:
            self.observer.records_out(topic, 1)

    def flush(self, timeout_s: float = 60.0) -> list[Any]:
        """Wait until the broker acknowledged every pending send; raise DeliveryError naming the topic if not."""
        self._producer.flush(timeout=timeout_s)
        pending, self._pending = self._pending, []
        metadata = []
        for topic, future in pending:
            try:
                metadata.append(future.get(timeout=timeout_s))
            except Exception as exc:  # kafka-python raises KafkaError subclasses or a timeout
                raise DeliveryError(f"send to {topic} was not acknowledged: {exc!r}") from exc
        return metadata

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.close(timeout=timeout_s)


class Source:
    """A consumer-group reader that decodes, validates and dead-letters, with explicit commits."""

    def __init__(self, consumer, sink: Sink, dlq_topic: str, expected_kind: str | tuple[str, ...] | None,
                 consumer_id: str, tracing: Tracing):
        self._consumer = consumer
        self._sink = sink
        self._dlq_topic = dlq_topic
        self._expected_kind = expected_kind
        self._consumer_id = consumer_id
        self._tracing = tracing
        self._next: dict[Any, int] = {}  # TopicPartition -> offset after the last record handed out
        self.dead_lettered = 0
        self.observer = None  # telemetry (records_in, dead_lettered); set by RoleTelemetry.attach
        self.paused = False  # while True, poll() fetches nothing (an alert's "pause"), group membership stays

    @property
    def consumer(self):
        return self._consumer

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Consumed]:
        """Fetch records; return the valid ones in partition order, dead-letter the rest."""
        self._apply_pause()
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        out: list[Consumed] = []
        for tp, records in batches.items():
            if self.observer is not None and records:
                self.observer.records_in(tp.topic, len(records),
                                         {(tp.topic, tp.partition): records[-1].offset + 1})
            for rec in records:
                self._next[tp] = rec.offset + 1
                headers = list(rec.headers or [])
                try:
                    value = decode(rec.value, self._expected_kind)
                except SchemaError as exc:
                    self.dead_letter(rec.topic, rec.partition, rec.offset, rec.key, rec.value, str(exc),
                                     "SchemaError")
                    continue
                out.append(Consumed(rec.topic, rec.partition, rec.offset, rec.key, value, headers,
                                    rec.timestamp, rec.value))
        return out

    def _apply_pause(self) -> None:
        """Pause every assigned partition while ``paused`` (re-applied each poll: a rebalance may add some)."""
        if self.paused:
            assigned = self._consumer.assignment()
            if assigned:
                self._consumer.pause(*assigned)
        elif self._consumer.paused():
            self._consumer.resume(*self._consumer.paused())

    def dead_letter(self, topic: str, partition: int, offset: int, key: bytes | None, raw: bytes | None,
                    reason: str, error_type: str) -> None:
        """Send one record to the dead-letter topic with its reason and origin (committed with the batch)."""
        self.dead_lettered += 1
        if self.observer is not None:
            self.observer.dead_lettered(topic, error_type)
        log.warning("dead-letter %s[%d]@%d: %s", topic, partition, offset, reason)
        letter = DeadLetter(reason=reason, error_type=error_type, source_topic=topic, source_partition=partition,
                            source_offset=offset, raw_value=raw or b"", raw_key=key,
                            consumer_id=self._consumer_id, created_at=time.time())
        self._sink.send(self._dlq_topic, letter, key=key)

    def commit(self, next_offsets: dict[Any, int] | None = None) -> bool:
        """Commit ``next_offsets`` (default: one past every record handed out). Sends must be flushed first.

        Returns False when a rebalance took the partitions away first (records will be redelivered)."""
        from kafka.errors import CommitFailedError, RebalanceInProgressError
        from kafka.structs import OffsetAndMetadata

        if self._sink.pending:
            raise RuntimeError(f"commit with {self._sink.pending} unacknowledged sends: call sink.flush() first")
        offsets = dict(self._next if next_offsets is None else next_offsets)
        if not offsets:
            return True
        try:
            self._consumer.commit({tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()})
        except (CommitFailedError, RebalanceInProgressError) as exc:
            log.warning("commit lost to a rebalance (records will be redelivered): %s", exc)
            self._next.clear()
            return False
        if next_offsets is None:
            self._next.clear()
        return True

    def process_span(self, name: str, records: Sequence[Consumed], attributes: dict[str, Any] | None = None):
        """Context manager: a span for processing ``records`` (child of one, or linked to many)."""
        return self._tracing.process_span(name, [r.headers for r in records], attributes)

    def close(self) -> None:
        self._consumer.close(autocommit=False)


def group_by_partition(records: Iterable[Consumed]) -> dict[tuple[str, int], list[Consumed]]:
    out: dict[tuple[str, int], list[Consumed]] = {}
    for rec in records:
        out.setdefault((rec.topic, rec.partition), []).append(rec)
    return out


def forget_partitions(source: Source, partitions: Iterable[Any]) -> None:
    """Drop uncommitted progress of partitions a rebalance took away (their records go to the new owner)."""
    for tp in partitions:
        source._next.pop(tp, None)
