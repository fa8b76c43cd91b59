"""The producer side of the transport edge: typed sends, acknowledged at ``flush``, bounded by broker liveness.

Consumes: a kafka-python producer built from :mod:`stream_rl.transport.settings` (or the in-process bus's,
:mod:`stream_rl.transport.memory`), schema messages, the :class:`~stream_rl.transport.settings.ClientProbe` that
says when the client last heard from a broker.
Produces: records on topics (value = ``schemas.encode(msg)``, key as given, W3C trace headers); :class:`Liveness`,
the broker-loss bound that :class:`~stream_rl.transport.edge.Source` shares; :func:`raw_budget`, the raw bytes a
dead letter may carry.
Guarantees (part of the delivery contract, :mod:`stream_rl.transport.edge`): ``pending`` counts every send the
broker has not acknowledged, and only ``flush`` clears it (``Source.commit`` refuses to run before); ``send`` and
``flush`` raise :class:`BrokerUnreachable` naming the bootstrap address once no broker answered for
``kafka.broker_timeout_s``, :class:`DeliveryError` naming the topic for a send that was not acknowledged, and
:class:`~stream_rl.transport.topics.TopicError` for a send to a topic that does not exist; an ``observer`` is told
the records of each topic acknowledged, once per flush. Every record is size-checked before it reaches the client:
one whose serialized size (value, key and headers, :func:`record_size`) exceeds ``kafka.max_request_size`` raises
:class:`RecordTooLarge` naming the topic and both sizes, and nothing is sent or left pending; the role catches it
and dead-letters the record the output came from (:meth:`Sink.oversize` asks the same question without sending).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from kafka.errors import KafkaTimeoutError

from schemas import encode
from stream_rl.transport.settings import ClientProbe
from stream_rl.transport.span_attributes import span_attributes
from stream_rl.transport.topics import TopicError
from stream_rl.transport.tracing import Headers, Tracing

log = logging.getLogger(__name__)


class DeliveryError(RuntimeError):
    """The broker did not acknowledge a send; nothing derived from it may be committed."""


class BrokerUnreachable(RuntimeError):
    """No broker answered for ``kafka.broker_timeout_s``: the role stops (non-zero) instead of retrying forever."""


class RecordTooLarge(ValueError):
    """An output whose serialized record exceeds ``kafka.max_request_size``: never sent (the client would refuse
    it on every retry); the role dead-letters the record it was derived from, with this message as the reason."""

    def __init__(self, topic: str, size: int, limit: int):
        super().__init__(f"output record for {topic} is {size} bytes serialized, more than kafka.max_request_size = "
                         f"{limit} bytes")
        self.topic, self.size, self.limit = topic, size, limit


DEFAULT_BROKER_TIMEOUT_S = 60.0
DEAD_LETTER_OVERHEAD = 16_384
"""Bytes of a dead letter's record kept for everything but the raw value (reason, ids, headers, framing)."""


HEADER_ALLOWANCE = 512
"""Bytes :meth:`Sink.oversize` allows for the headers a send adds (``traceparent``, ``tracestate``)."""


def record_size(value: bytes | None, key: bytes | None, headers: Headers = ()) -> int:
    """Bytes of one record as the client counts it against ``max_request_size``: kafka-python's estimate of a
    one-record batch (v2 framing, varints, the batch header) of ``key``, ``value`` and ``headers``."""
    from kafka.record.default_records import DefaultRecordBatchBuilder

    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, list(headers or ()))


def raw_budget(max_request_size: int, key: bytes | None) -> int:
    """Raw value bytes a dead letter may carry: half the request limit, less its key (sent twice) and overhead."""
    return max(0, max_request_size // 2 - 2 * len(key or b"") - DEAD_LETTER_OVERHEAD)


_heard: dict[str, float] = {}  # bootstrap address -> time.monotonic() of this process's last answer from it


def silent_for(bootstrap: str) -> float | None:
    """Seconds since any client of this process last heard from the cluster at ``bootstrap`` (a poll, a send or a
    flush that reached it); None when none ever did. An error raised by a client built during an outage names
    this, not the few seconds that one client tried."""
    last = _heard.get(bootstrap)
    return None if last is None else time.monotonic() - last


class Liveness:
    """When a client last heard from a broker; :meth:`check` raises BrokerUnreachable past the bound."""

    def __init__(self, probe: ClientProbe | None, timeout_s: float, bootstrap: str):
        self.probe, self.timeout_s, self.bootstrap = probe, timeout_s, bootstrap
        self.last_contact = time.monotonic()

    def update(self) -> None:
        heard = self.probe.last_heard() if self.probe is not None else None
        if heard is not None:
            self.last_contact = max(self.last_contact, heard)
            _heard[self.bootstrap] = max(_heard.get(self.bootstrap, heard), heard)

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


class Sink:
    """Sends messages and knows which sends the broker has not acknowledged yet."""

    def __init__(self, producer, tracing: Tracing, *, probe: ClientProbe | None = None,
                 broker_timeout_s: float = DEFAULT_BROKER_TIMEOUT_S, bootstrap: str = "?",
                 max_request_size: int = 1_048_576):
        self._producer = producer
        self._tracing = tracing
        self._pending: list[tuple[str, Any]] = []
        self._liveness = Liveness(probe, broker_timeout_s, bootstrap)
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

    def oversize(self, topic: str, message: Any, key: str | bytes | None = None) -> RecordTooLarge | None:
        """The :class:`RecordTooLarge` that sending ``message`` would raise (headers counted as
        :data:`HEADER_ALLOWANCE` bytes), else None; sends nothing. For a role that must know that a whole group fits
        before it sends any of it."""
        key = key.encode() if isinstance(key, str) else key
        size = record_size(encode(message), key) + HEADER_ALLOWANCE
        return RecordTooLarge(topic, size, self.max_request_size) if size > self.max_request_size else None

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
        size = record_size(value, key, headers)
        if size > self.max_request_size:
            raise RecordTooLarge(topic, size, self.max_request_size)
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
        """Close the producer, waiting up to ``timeout_s`` for what it still holds. With no broker to take it, the
        rest is dropped with a warning, never an exception: a close runs on the way out of a role, often after the
        error that ends it (which it must not replace), and nothing unacknowledged was ever committed from."""
        try:
            self._producer.close(timeout=timeout_s)
        except KafkaTimeoutError as exc:
            abandon(self._producer)
            log.warning("producer closed with records unsent after %gs (no broker took them; none was committed "
                        "from): %r", timeout_s, exc)


def abandon(producer) -> None:
    """Force-close a kafka-python producer whose ``close`` raised. kafka-python 3.0.12's ``close`` raises from its
    flush when records are still unsent and leaves the producer open, so its ``__del__`` closes it again at exit
    and prints an "Exception ignored" traceback after the role's last line; stopping the sender thread and marking
    the producer closed ends it here (its unsent records are dropped: none was acknowledged, none committed from)."""
    sender = getattr(producer, "_sender", None)
    if sender is not None and sender.is_alive():
        sender.force_close()
        sender.join(1.0)
    if hasattr(producer, "_closed"):
        producer._closed = True
