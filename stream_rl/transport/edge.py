"""The transport edge: typed sends and typed, validated, dead-lettering receives with manual commits.

Consumes: kafka-python producers/consumers built from :mod:`stream_rl.transport.settings` (or the in-process bus's,
:mod:`stream_rl.transport.memory`, same contract), schema messages.
Produces: records on topics (value = ``schemas.encode(msg)``, key as given, W3C trace headers) through a
:class:`~stream_rl.transport.sink.Sink` (the producer side with the broker-loss bound, :mod:`stream_rl.transport.sink`),
and :class:`Consumed` items (decoded, validated messages with their topic/partition/offset/headers) from a
:class:`Source` (here). The key rules live in :mod:`stream_rl.transport.keys`; this module re-exports the names of
both.
Guarantees (the delivery contract every role loop relies on)::

    poll() ──> [records] ──> caller's pure step ──> sink.send(outputs) ──> sink.flush() ──> source.commit()
                  │                                                          (broker acked)   (last_offset + 1)
                  └─ undecodable / invalid ──> sink.send(DLQ, DeadLetter(reason, source offset, raw bytes))

- On a role's input (a source with an expected kind), a prompt, rollout or scored rollout whose record key is
  not its documented key (``prompt_id``, ``group_id``) is dead-lettered the same way (``KeyError``): keys
  decide partitions.
- A record that fails to decode or validate is sent to the run's dead-letter topic with the reason, the
  source topic/partition/offset and its raw bytes, and the consumer moves on; it is committed with the good ones.
  The dead letter continues the rejected record's trace (its send span descends from the record's context).
- A record batch the client cannot read at all (a compression codec it lacks, a corrupt batch, a record too
  large; see :mod:`stream_rl.transport.unreadable`) is dead-lettered one offset at a time (``raw_value`` nil,
  the error as reason) and the consumer seeks past it: a role never crash-loops on one offset.
- A dead letter always fits the producer's ``max_request_size``: raw bytes beyond half of it are cut
  (``raw_truncated``, with the whole value's ``raw_size`` and ``raw_sha256``; the record itself stays at its
  source coordinates, to replay from there).
- Bounded broker loss: ``poll``, ``send`` and ``flush`` raise :class:`BrokerUnreachable` naming the bootstrap
  address once the client has heard from no broker for ``kafka.broker_timeout_s``; every role loop exits
  non-zero on it. A send to a topic that does not exist raises :class:`~stream_rl.transport.topics.TopicError`
  naming the topic and ``stream-rl topics create`` (no client auto-creates topics, see settings.py).
- ``commit`` refuses to run while the sink holds unacknowledged sends, so an offset is never committed before
  the outputs derived from it (and the dead letters) are durable on the broker.
- A group member that is given no partition within ``kafka.assignment_timeout_s`` while its group is not
  stable raises :class:`~stream_rl.transport.membership.NoAssignment` (the role exits non-zero naming the group);
  a member of a stable group that got nothing (more members than partitions) logs that once and idles.
- A role configures its source when it builds it (``Transport.source``), never by setting attributes afterwards:
  ``pause_when`` (the role's ``telemetry.paused``: an alert with action ``pause`` fires) is asked at every
  ``poll``; while it holds, every assigned partition is paused, so ``poll`` returns nothing while the consumer
  stays in its group, and once it no longer holds they resume. ``keep_rejections``: every record the edge
  dead-lettered is kept (:mod:`~stream_rl.transport.rejections`) until the role takes them
  (:meth:`Source.take_rejections`), to name the group that can no longer complete.
- An ``observer`` (the role's telemetry, attached by it) is told of every record fetched, sent (per topic, when a
  flush has seen it acknowledged) and dead-lettered. ``holds``, the partitions kept paused by a reader that
  positions the source by its own rules, is that reader's state: the producer's epoch gate, built on the source,
  hands it its ``held`` map; a bounded range read (:mod:`~stream_rl.transport.ranges`) its finished partitions.
- Business code never sees a client object: a :class:`Source` answers where reading stands (``assignment``,
  ``position``, ``committed``, ``highwater``) and moves it (``seek``, ``assign``, ``unsubscribe``) in plain
  ``(topic, partition)`` pairs, and ``commit`` takes ``{(topic, partition): next offset}``.
- A commit that loses a rebalance race is not an error: the records are redelivered to the partition's new
  owner (at-least-once), and consumers downstream drop duplicates by record id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import DeadLetter, SchemaError, decode
from stream_rl.transport.keys import KEY_FIELDS, key_problem
from stream_rl.transport.membership import AssignmentWatch, close_consumer
from stream_rl.transport.reader import list_partitions, topic_partition
from stream_rl.transport.rejections import EdgeRejection
from stream_rl.transport.settings import ClientProbe
from stream_rl.transport.sink import (
    DEFAULT_BROKER_TIMEOUT_S,
    BrokerUnreachable,
    DeliveryError,
    Liveness,
    RecordTooLarge,
    Sink,
    raw_budget,
)
from stream_rl.transport.tracing import Headers, Tracing, current_headers, extract_span_context
from stream_rl.transport.unreadable import Unreadable, find_unreadable

__all__ = ["KEY_FIELDS", "BrokerUnreachable", "Consumed", "DeliveryError", "RecordTooLarge", "Sink", "Source", "forget_partitions",
           "group_by_partition", "key_problem", "raw_budget", "resume"]
"""The edge's names, including those its parts define (:mod:`~stream_rl.transport.sink`,
:mod:`~stream_rl.transport.keys`), so that ``from stream_rl.transport.edge import X`` serves every one."""

log = logging.getLogger(__name__)


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


class Source:
    """A consumer-group reader that decodes, validates and dead-letters, with explicit commits."""

    def __init__(self, consumer, sink: Sink, dlq_topic: str, expected_kind: str | tuple[str, ...] | None,
                 consumer_id: str, tracing: Tracing, *, probe: ClientProbe | None = None,
                 broker_timeout_s: float = DEFAULT_BROKER_TIMEOUT_S, bootstrap: str = "?",
                 assignment_timeout_s: float | None = None, leave_group: bool = False,
                 keep_rejections: bool = False, pause_when: Callable[[], bool] | None = None):
        self._consumer = consumer
        self._leave_group = leave_group
        self._watch = AssignmentWatch(assignment_timeout_s)
        self._liveness = Liveness(probe, broker_timeout_s, bootstrap)
        self._sink = sink
        self._dlq_topic = dlq_topic
        self._expected_kind = expected_kind
        self._consumer_id = consumer_id
        self._tracing = tracing
        self._next: dict[Any, int] = {}  # TopicPartition -> offset after the last record handed out
        self.dead_lettered = 0
        self.observer = None  # telemetry (records_in, dead_lettered); set by RoleTelemetry.attach
        self.rejections: list | None = [] if keep_rejections else None  # an EdgeRejection per edge dead letter
        self._pause_when = pause_when  # while it returns True, poll() fetches nothing; group membership stays
        self.holds: Container = ()  # partitions a role holds paused on its own (the producer's epoch gate)

    @property
    def paused(self) -> bool:
        """Whether ``poll`` fetches nothing now (``pause_when``: an alert's "pause")."""
        return self._pause_when is not None and bool(self._pause_when())

    def take_rejections(self) -> list:
        """The :class:`EdgeRejection` of every record dead-lettered here since the last call (``keep_rejections``;
        always empty without it)."""
        taken = self.rejections or []
        if self.rejections is not None:
            self.rejections = []
        return taken

    # -- where reading stands, in plain (topic, partition) pairs (business code never sees the client) ------------

    def assignment(self) -> set[tuple[str, int]]:
        """The partitions this source reads now (a group member's change at a rebalance, seen at ``poll``)."""
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def position(self, topic: str, partition: int) -> int:
        """The offset of the next record ``poll`` hands out from an assigned partition."""
        return self._consumer.position(topic_partition((topic, partition)))

    def committed(self, topic: str, partition: int, timeout_s: float = 10.0) -> int | None:
        """The group's committed offset of a partition (None: none), asked of the broker."""
        return self._consumer.committed(topic_partition((topic, partition)), timeout_ms=int(timeout_s * 1000))

    def highwater(self, topic: str, partition: int) -> int | None:
        """An assigned partition's high-water mark as of the last fetch (None before one; no request)."""
        return self._consumer.highwater(topic_partition((topic, partition)))

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read an assigned partition from ``offset`` at the next ``poll``."""
        self._consumer.seek(topic_partition((topic, partition)), offset)

    def partitions(self, topic: str, timeout_s: float = 10.0) -> list[tuple[str, int]]:
        """Every partition of ``topic``; KeyError naming it when it does not exist within ``timeout_s``."""
        return list_partitions(self._consumer, topic, timeout_s)

    def unsubscribe(self) -> None:
        """Drop the group subscription (before any poll: no join was started, so nothing is sent to the group)."""
        self._consumer.unsubscribe()

    def assign(self, offsets: dict[tuple[str, int], int]) -> None:
        """Read exactly these partitions (no group membership), each from its given offset."""
        self._consumer.assign([topic_partition(key) for key in offsets])
        for (topic, partition), offset in offsets.items():
            self.seek(topic, partition, offset)

    def beginning_offsets(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The first offset the broker still holds (low watermark) of each partition."""
        found = self._consumer.beginning_offsets([topic_partition(key) for key in partitions])
        return {(tp.topic, tp.partition): int(off) for tp, off in found.items()}

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[Consumed]:
        """Fetch records; return the valid ones in partition order, dead-letter the rest (undecodable or
        invalid records, unreadable batches). Raises BrokerUnreachable past ``kafka.broker_timeout_s``."""
        self._apply_pause()
        try:
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except Exception as exc:  # only an unreadable batch is handled here; anything else propagates
            where = find_unreadable(self._consumer, exc)
            if where is None:
                raise
            self._skip_unreadable(where)
            batches = {}
        self._liveness.check("polling " + ", ".join(sorted(self._consumer.subscription() or ())))
        self._watch.check(self._consumer)
        out: list[Consumed] = []
        for tp, records in batches.items():
            if records:
                self._accept(tp, records, out)
        return out

    def _accept(self, tp: Any, records: Sequence[Any], out: list[Consumed]) -> None:
        """Decode and validate one partition's fetched ``records`` into ``out``; dead-letter the bad ones."""
        if self.observer is not None:
            self.observer.records_in(tp.topic, len(records), {(tp.topic, tp.partition): records[-1].offset + 1})
        expected, check_key = self._expected_kind, self._expected_kind is not None
        for rec in records:
            headers = list(rec.headers or ())
            try:
                value = decode(rec.value, expected)
            except SchemaError as exc:
                self._reject(rec, None, str(exc), "SchemaError", headers)
                continue
            problem = key_problem(value, rec.key) if check_key else None
            if problem is not None:
                self._reject(rec, value, problem, "KeyError", headers)
                continue
            out.append(Consumed(rec.topic, rec.partition, rec.offset, rec.key, value, headers, rec.timestamp,
                                rec.value))
        self._next[tp] = records[-1].offset + 1  # once per batch: every record up to it was handed out or rejected

    def _reject(self, rec, value: Any, reason: str, error_type: str, headers: Headers) -> None:
        self.dead_letter(rec.topic, rec.partition, rec.offset, rec.key, rec.value, reason, error_type,
                         headers=headers)
        if self.rejections is not None:
            self.rejections.append(EdgeRejection(rec.topic, rec.partition, rec.offset, rec.key, value, reason,
                                                 error_type))

    def _skip_unreadable(self, where: Unreadable) -> None:
        """Dead-letter every offset of an unreadable batch and seek past it (committed with the next batch)."""
        tp = where.tp
        log.error("%s[%d] offsets %d..%d cannot be read by this client (%s): dead-lettered and skipped",
                  tp.topic, tp.partition, where.first, where.last, where.error_type)
        for offset in range(where.first, where.last + 1):
            reason = f"{where.reason} (offsets {where.first}..{where.last})"
            self.dead_letter(tp.topic, tp.partition, offset, None, None, reason, where.error_type)
            if self.rejections is not None:
                self.rejections.append(EdgeRejection(tp.topic, tp.partition, offset, None, None, reason,
                                                     where.error_type))
        self._consumer.seek(tp, where.last + 1)
        self._next[tp] = where.last + 1

    def _apply_pause(self) -> None:
        """Pause every assigned partition while ``paused``, else exactly those in ``holds`` (re-applied each
        poll: a rebalance may add some)."""
        assigned = self._consumer.assignment()
        if self.paused:
            if assigned:
                self._consumer.pause(*assigned)
            return
        held = [tp for tp in assigned if tp in self.holds]
        if held:
            self._consumer.pause(*held)
        released = [tp for tp in self._consumer.paused() if tp not in self.holds]
        if released:
            resume(self._consumer, released)

    def dead_letter(self, topic: str, partition: int, offset: int, key: bytes | None, raw: bytes | None,
                    reason: str, error_type: str, *, headers: Headers | None = None) -> None:
        """Send one record to the dead-letter topic with its reason and origin (committed with the batch).

        ``raw`` is kept whole when it fits, else cut (see :func:`raw_budget`); ``headers`` (the rejected
        record's) make the dead letter continue that record's trace."""
        self.dead_lettered += 1
        if self.observer is not None:
            self.observer.dead_lettered(topic, error_type)
        log.warning("dead-letter %s[%d]@%d: %s", topic, partition, offset, reason[:500])
        letter = DeadLetter.of_value(
            raw, raw_budget(self._sink.max_request_size, key), reason=reason[:4000] or error_type,
            error_type=error_type, source_topic=topic, source_partition=partition, source_offset=offset,
            raw_key=key, consumer_id=self._consumer_id, created_at=time.time())
        if extract_span_context(headers) is None:  # no trace to continue: child of the current span, if any
            self._sink.send(self._dlq_topic, letter, key=key)
            return
        with self._tracing.process_span("dead-letter", [list(headers or [])],
                                        {"stream_rl.error_type": error_type}):
            self._sink.send(self._dlq_topic, letter, key=key)

    def dead_letter_record(self, record: Consumed, reason: str, error_type: str) -> None:
        """:meth:`dead_letter` of a record this source handed out (its raw bytes, key and trace)."""
        self.dead_letter(record.topic, record.partition, record.offset, record.key, record.raw_value, reason,
                         error_type, headers=record.headers)

    def commit(self, next_offsets: dict[tuple[str, int], int] | None = None) -> bool:
        """Commit ``next_offsets``, ``{(topic, partition): offset}`` (default: one past every record handed out).
        Sends must be flushed first.

        Returns False when a rebalance took the partitions away first (records will be redelivered)."""
        from kafka.errors import CommitFailedError, RebalanceInProgressError
        from kafka.structs import OffsetAndMetadata

        if self._sink.pending:
            raise RuntimeError(f"commit with {self._sink.pending} unacknowledged sends: call sink.flush() first")
        offsets = dict(self._next if next_offsets is None else next_offsets)
        if not offsets:
            return True
        try:
            self._consumer.commit({topic_partition(tp): OffsetAndMetadata(off, "", -1)
                                   for tp, off in offsets.items()})
        except (CommitFailedError, RebalanceInProgressError) as exc:
            log.warning("commit lost to a rebalance (records will be redelivered): %s", exc)
            self._next.clear()
            return False
        if next_offsets is None:
            self._next.clear()
        return True

    @staticmethod
    def trace_headers() -> Headers:
        """The current span's context as headers: hand them to :meth:`process_span_of` later to continue it."""
        return current_headers()

    def process_span_of(self, name: str, headers: Headers, attributes: dict[str, Any] | None = None):
        """Context manager: a span continuing ``headers``' trace (a record's, or :meth:`trace_headers`')."""
        return self._tracing.process_span(name, [list(headers or [])], attributes)

    def process_span(self, name: str, records: Sequence[Consumed], attributes: dict[str, Any] | None = None):
        """Context manager: a span for processing ``records`` (child of one, or linked to many)."""
        return self._tracing.process_span(name, [r.headers for r in records], attributes)

    def close(self) -> None:
        close_consumer(self._consumer, leave=self._leave_group)


def resume(consumer, partitions: Sequence[Any]) -> None:
    """Resume ``partitions`` of a kafka-python consumer so that they are fetched again.

    kafka-python 3.0.12 parks the parsed records of a partition paused mid-fetch and restores them only when no
    other partition's records are in line; while other partitions keep flowing they stay parked, and a parked
    partition is never fetched again (observed: a paused-then-resumed partition returned nothing for 60 polls).
    The parked records are dropped here: the position did not move, so the next fetch reads them again."""
    consumer.resume(*partitions)
    parked = getattr(getattr(consumer, "_fetcher", None), "_paused_partition_records", None)
    if isinstance(parked, dict):
        for tp in partitions:
            records = parked.pop(tp, None)
            if records is not None:
                records.drain()


def group_by_partition(records: Iterable[Consumed]) -> dict[tuple[str, int], list[Consumed]]:
    out: dict[tuple[str, int], list[Consumed]] = {}
    for rec in records:
        out.setdefault((rec.topic, rec.partition), []).append(rec)
    return out


def forget_partitions(source: Source, partitions: Iterable[Any]) -> None:
    """Drop uncommitted progress of partitions a rebalance took away (their records go to the new owner)."""
    for tp in partitions:
        source._next.pop(tp, None)
