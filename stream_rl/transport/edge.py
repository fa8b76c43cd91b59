"""The transport edge: typed sends and typed, validated, dead-lettering receives with manual commits.

Consumes: kafka-python producers/consumers built from :mod:`stream_rl.transport.settings` (or the in-process bus's,
:mod:`stream_rl.transport.memory`, same contract), schema messages.
Produces: records on topics (value = ``schemas.encode(msg)``, key as given, W3C trace headers), and
:class:`Consumed` items (decoded, validated messages with their topic/partition/offset/headers).
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
- ``paused`` (set by the loop while an alert with action ``pause`` fires) pauses every assigned partition, so
  ``poll`` returns nothing while the consumer stays in its group; clearing it resumes them.
- An ``observer`` (the role's telemetry) is told of every record fetched, sent (per topic, when a flush has seen
  it acknowledged) and dead-lettered; a role that
  sets ``rejections`` to a list is handed every record the edge dead-lettered (:mod:`~stream_rl.transport.rejections`),
  to name the group that can no longer complete.
- Business code never sees a client object: a :class:`Source` answers where reading stands (``assignment``,
  ``position``, ``committed``, ``highwater``) and moves it (``seek``, ``assign``, ``unsubscribe``) in plain
  ``(topic, partition)`` pairs, and ``commit`` takes ``{(topic, partition): next offset}``.
- A commit that loses a rebalance race is not an error: the records are redelivered to the partition's new
  owner (at-least-once), and consumers downstream drop duplicates by record id.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kafka.errors import KafkaTimeoutError

from schemas import DeadLetter, SchemaError, decode, encode
from stream_rl.transport.membership import AssignmentWatch, close_consumer
from stream_rl.transport.rejections import EdgeRejection
from stream_rl.transport.settings import ClientProbe
from stream_rl.transport.span_attributes import span_attributes
from stream_rl.transport.topics import TopicError
from stream_rl.transport.tracing import Headers, Tracing, current_headers, extract_span_context
from stream_rl.transport.unreadable import Unreadable, find_unreadable

log = logging.getLogger(__name__)


class DeliveryError(RuntimeError):
    """The broker did not acknowledge a send; nothing derived from it may be committed."""


class BrokerUnreachable(RuntimeError):
    """No broker answered for ``kafka.broker_timeout_s``: the role stops (non-zero) instead of retrying forever."""


DEFAULT_BROKER_TIMEOUT_S = 60.0
DEAD_LETTER_OVERHEAD = 16_384
"""Bytes of a dead letter's record kept for everything but the raw value (reason, ids, headers, framing)."""


def raw_budget(max_request_size: int, key: bytes | None) -> int:
    """Raw value bytes a dead letter may carry: half the request limit, less its key (sent twice) and overhead."""
    return max(0, max_request_size // 2 - 2 * len(key or b"") - DEAD_LETTER_OVERHEAD)


class _Liveness:
    """When a client last heard from a broker; :meth:`check` raises BrokerUnreachable past the bound."""

    def __init__(self, probe: ClientProbe | None, timeout_s: float, bootstrap: str):
        self.probe, self.timeout_s, self.bootstrap = probe, timeout_s, bootstrap
        self.last_contact = time.monotonic()

    def update(self) -> None:
        heard = self.probe.last_heard() if self.probe is not None else None
        if heard is not None:
            self.last_contact = max(self.last_contact, heard)

    def lost(self) -> bool:
        self.update()
        return self.probe is not None and time.monotonic() - self.last_contact > self.timeout_s

    def error(self, doing: str, cause: BaseException | None = None) -> BrokerUnreachable:
        silent = time.monotonic() - self.last_contact
        detail = f": {cause!r}" if cause is not None else ""
        return BrokerUnreachable(f"broker {self.bootstrap} unreachable: no answer for {silent:.0f}s while "
                                 f"{doing} (kafka.broker_timeout_s={self.timeout_s:g}){detail}")

    def check(self, doing: str) -> None:
        if self.lost():
            raise self.error(doing)


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


class Sink:
    """Sends messages and knows which sends the broker has not acknowledged yet."""

    def __init__(self, producer, tracing: Tracing, *, probe: ClientProbe | None = None,
                 broker_timeout_s: float = DEFAULT_BROKER_TIMEOUT_S, bootstrap: str = "?",
                 max_request_size: int = 1_048_576):
        self._producer = producer
        self._tracing = tracing
        self._pending: list[tuple[str, Any]] = []
        self._liveness = _Liveness(probe, broker_timeout_s, bootstrap)
        self.max_request_size = max_request_size
        self.observer = None  # telemetry (records_out, counted at flush); set by RoleTelemetry.attach

    @property
    def pending(self) -> int:
        return len(self._pending)

    def send(self, topic: str, message: Any, key: str | bytes | None = None, headers: Headers | None = None,
             partition: int | None = None, attributes: dict[str, Any] | None = None) -> None:
        """Validate and encode ``message`` (raises SchemaError on an invalid one), then send it."""
        value = encode(message)
        if self._tracing.records_spans:  # span attributes are built only for a span that is recorded
            attributes = {"stream_rl.kind": getattr(message, "KIND", "?"), **span_attributes(message),
                          **(attributes or {})}
        self.send_raw(topic, value, key, headers, partition, attributes)

    def send_raw(self, topic: str, value: bytes, key: str | bytes | None = None, headers: Headers | None = None,
                 partition: int | None = None, attributes: dict[str, Any] | None = None) -> None:
        """Send ``value`` as is, with a ``traceparent`` header continuing the current trace (a send span when
        tracing records one)."""
        key = key.encode() if isinstance(key, str) else key
        if not self._tracing.records_spans:
            future = self._submit(topic, value, key, self._tracing.send_headers(headers or ()), partition)
        else:
            with self._tracing.send_span(topic, key, list(headers or []), attributes) as hdrs:
                future = self._submit(topic, value, key, hdrs, partition)
        self._pending.append((topic, future))

    def _submit(self, topic: str, value: bytes, key: bytes | None, headers: Headers, partition: int | None):
        try:
            return self._producer.send(topic, value=value, key=key, headers=headers, partition=partition)
        except KafkaTimeoutError as exc:  # waited max_block_ms (= kafka.broker_timeout_s) for metadata/buffer
            raise self._send_timeout(topic, exc) from exc

    def _send_timeout(self, topic: str, exc: BaseException) -> RuntimeError:
        if self._liveness.lost():
            return self._liveness.error(f"sending to {topic}", exc)
        if self._liveness.probe is not None and not self._liveness.probe.knows_topic(topic):
            return TopicError(f"topic {topic} does not exist on {self._liveness.bootstrap} (roles never create "
                              f"topics): create the run's topics with `stream-rl topics create`")
        return DeliveryError(f"send to {topic} blocked for {self._liveness.timeout_s:g}s: {exc!r}")

    def flush(self, timeout_s: float | None = None) -> list[Any]:
        """Wait until the broker acknowledged every pending send (at most ``timeout_s``, default
        ``kafka.broker_timeout_s``); raise BrokerUnreachable when no broker answered for that bound, else
        DeliveryError naming the topic."""
        timeout_s = self._liveness.timeout_s if timeout_s is None else timeout_s
        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaTimeoutError as exc:
            if self._liveness.lost():
                count, self._pending = len(self._pending), []
                raise self._liveness.error(f"flushing {count} sends", exc) from exc
        pending, self._pending = self._pending, []
        metadata = []
        for topic, future in pending:
            try:
                metadata.append(future.get(timeout=timeout_s))
            except Exception as exc:  # kafka-python raises KafkaError subclasses or a timeout
                if self._liveness.lost():
                    raise self._liveness.error(f"waiting for the ack of a send to {topic}", exc) from exc
                raise DeliveryError(f"send to {topic} was not acknowledged: {exc!r}") from exc
        self._liveness.update()
        if self.observer is not None:  # counted once acknowledged, per topic per flush (not per record)
            for topic, n in Counter(topic for topic, _ in pending).items():
                self.observer.records_out(topic, n)
        return metadata

    def close(self, timeout_s: float = 10.0) -> None:
        self._producer.close(timeout=timeout_s)


class Source:
    """A consumer-group reader that decodes, validates and dead-letters, with explicit commits."""

    def __init__(self, consumer, sink: Sink, dlq_topic: str, expected_kind: str | tuple[str, ...] | None,
                 consumer_id: str, tracing: Tracing, *, probe: ClientProbe | None = None,
                 broker_timeout_s: float = DEFAULT_BROKER_TIMEOUT_S, bootstrap: str = "?",
                 assignment_timeout_s: float | None = None, leave_group: bool = False):
        self._consumer = consumer
        self._leave_group = leave_group
        self._watch = AssignmentWatch(assignment_timeout_s)
        self._liveness = _Liveness(probe, broker_timeout_s, bootstrap)
        self._sink = sink
        self._dlq_topic = dlq_topic
        self._expected_kind = expected_kind
        self._consumer_id = consumer_id
        self._tracing = tracing
        self._next: dict[Any, int] = {}  # TopicPartition -> offset after the last record handed out
        self.dead_lettered = 0
        self.observer = None  # telemetry (records_in, dead_lettered); set by RoleTelemetry.attach
        self.rejections: list | None = None  # a role that sets a list gets an EdgeRejection per edge dead letter
        self.paused = False  # while True, poll() fetches nothing (an alert's "pause"), group membership stays
        self.holds: Container = ()  # partitions a role holds paused on its own (the producer's epoch gate)

    # -- where reading stands, in plain (topic, partition) pairs (business code never sees the client) ------------

    def assignment(self) -> set[tuple[str, int]]:
        """The partitions this source reads now (a group member's change at a rebalance, seen at ``poll``)."""
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def position(self, topic: str, partition: int) -> int:
        """The offset of the next record ``poll`` hands out from an assigned partition."""
        return self._consumer.position(_tp(topic, partition))

    def committed(self, topic: str, partition: int, timeout_s: float = 10.0) -> int | None:
        """The group's committed offset of a partition (None: none), asked of the broker."""
        return self._consumer.committed(_tp(topic, partition), timeout_ms=int(timeout_s * 1000))

    def highwater(self, topic: str, partition: int) -> int | None:
        """An assigned partition's high-water mark as of the last fetch (None before one; no request)."""
        return self._consumer.highwater(_tp(topic, partition))

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read an assigned partition from ``offset`` at the next ``poll``."""
        self._consumer.seek(_tp(topic, partition), offset)

    def partitions(self, topic: str, timeout_s: float = 10.0) -> list[tuple[str, int]]:
        """Every partition of ``topic``; KeyError naming it when it does not exist within ``timeout_s``."""
        from stream_rl.transport.client import partitions_of

        return [(tp.topic, tp.partition) for tp in partitions_of(self._consumer, topic, timeout_s)]

    def unsubscribe(self) -> None:
        """Drop the group subscription (before any poll: no join was started, so nothing is sent to the group)."""
        self._consumer.unsubscribe()

    def assign(self, offsets: dict[tuple[str, int], int]) -> None:
        """Read exactly these partitions (no group membership), each from its given offset."""
        self._consumer.assign([_tp(*key) for key in offsets])
        for (topic, partition), offset in offsets.items():
            self.seek(topic, partition, offset)

    def beginning_offsets(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The first offset the broker still holds (low watermark) of each partition."""
        found = self._consumer.beginning_offsets([_tp(*key) for key in partitions])
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
            self._consumer.commit({_tp(*tp): OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()})
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


KEY_FIELDS = {"prompt": "prompt_id", "rollout": "group_id", "scored_rollout": "group_id",
              "member_rejected": "group_id"}
"""The documented record key of each kind that roles consume in groups (docs/wire-format.md): the key decides
the partition (murmur2 of the key, as kafka-python and Apache Kafka's Java client place it), and a group must
stay on one partition."""


def _tp(topic: str, partition: int):
    """kafka-python's partition type (a named tuple: equal to, and hashed like, the plain pair)."""
    from kafka.structs import TopicPartition

    return TopicPartition(topic, partition)


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


def key_problem(value: Any, key: bytes | None) -> str | None:
    """Why ``key`` is not the documented key of ``value`` (None when it is, or the kind has no key rule)."""
    name = KEY_FIELDS.get(getattr(value, "KIND", ""))
    if name is None:
        return None
    want = getattr(value, name).encode()
    if key != want:
        return (f"record key {key!r:.80} is not the documented key ({name} {want!r:.80}): "
                f"keys decide partitions, so a group must be keyed by its {name}")
    return None


def group_by_partition(records: Iterable[Consumed]) -> dict[tuple[str, int], list[Consumed]]:
    out: dict[tuple[str, int], list[Consumed]] = {}
    for rec in records:
        out.setdefault((rec.topic, rec.partition), []).append(rec)
    return out


def forget_partitions(source: Source, partitions: Iterable[Any]) -> None:
    """Drop uncommitted progress of partitions a rebalance took away (their records go to the new owner)."""
    for tp in partitions:
        source._next.pop(tp, None)
