"""Builds the transport edge for a role from the config, and reads topics without a consumer group.

Consumes: a :class:`~stream_rl.config.SharedConfig`.
Produces: :class:`~stream_rl.transport.edge.Sink` / :class:`~stream_rl.transport.edge.Source` objects, an admin
client, and group-less readers for replay, topic listing and lag (high-water marks from fetch responses).
Guarantees: every client gets its settings from :mod:`stream_rl.transport.settings`; group-less reads never commit.
``kafka.bootstrap_servers = "memory://<name>"`` builds the clients of the in-process bus of that name instead
(:mod:`stream_rl.transport.memory`, same contract, no broker).
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition

from stream_rl.broker import resolve_bootstrap
from stream_rl.config.shared import SharedConfig
from stream_rl.transport.edge import Sink, Source, forget_partitions
from stream_rl.transport.settings import ClientProbe, consumer_settings, producer_settings
from stream_rl.transport.topics import TopicNames, ensure_topics
from stream_rl.transport.tracing import Tracing
from stream_rl.transport.unreadable import SkippedRecord, find_unreadable


class _Forget(ConsumerRebalanceListener):
    def __init__(self, source: Source):
        self.source = source

    def on_partitions_revoked(self, revoked):
        forget_partitions(self.source, revoked)

    def on_partitions_assigned(self, assigned):
        return None


class Transport:
    """Kafka access for one process of one role."""

    def __init__(self, cfg: SharedConfig, service: str, tracing: Tracing | None = None):
        self.cfg = cfg
        self.service = service
        self.instance_id = f"{service}-{uuid.uuid4().hex[:8]}"
        self.bootstrap = resolve_bootstrap(cfg.kafka.bootstrap_servers, cfg.broker)
        self.names = TopicNames.from_config(cfg.topics)
        self.tracing = tracing or Tracing.from_config(cfg.tracing, service, cfg.run_dir)

    def without_spans(self) -> Transport:
        """This process's Kafka access again (same instance id, config and topic names) with a tracer that records
        no spans: for telemetry's own clients (heartbeats), whose sends belong to no trace."""
        quiet = copy.copy(self)
        quiet.tracing = Tracing(f"{self.service}-telemetry")
        return quiet

    @property
    def bus(self):
        """The in-process bus of a ``memory://`` bootstrap address, else None (a Kafka cluster)."""
        from stream_rl.transport import memory

        name = memory.memory_name(self.bootstrap)
        return None if name is None else memory.bus(name)

    def admin(self) -> KafkaAdminClient:
        from stream_rl.transport.admin import admin_client

        return admin_client(self.cfg.kafka, self.bootstrap, self.instance_id)

    def ensure_topics(self, extra: dict[str, int] | None = None) -> dict[str, int]:
        admin = self.admin()
        try:
            return ensure_topics(admin, self.cfg.topics, extra=extra)
        finally:
            admin.close()

    def sink(self) -> Sink:
        """A producer edge: sends bounded by ``kafka.broker_timeout_s``, dead letters cut to fit."""
        probe, kafka = ClientProbe(), self.cfg.kafka
        if self.bus is not None:
            from stream_rl.transport.memory import MemoryProducer

            probe, producer = None, MemoryProducer(self.bus, kafka.max_request_size)
        else:
            producer = KafkaProducer(**producer_settings(kafka, self.bootstrap, self.instance_id, probe))
        return Sink(producer, self.tracing, probe=probe, broker_timeout_s=kafka.broker_timeout_s,
                    bootstrap=self.bootstrap, max_request_size=kafka.max_request_size)

    def source(self, topics: Sequence[str], group_id: str, expected_kind: str | tuple[str, ...] | None,
               sink: Sink) -> Source:
        """A group consumer on ``topics`` (full names) whose invalid records go to the run's DLQ via ``sink``."""
        probe = ClientProbe()
        consumer = self.consumer(group_id, probe)
        source = Source(consumer, sink, self.names.dlq, expected_kind, self.instance_id, self.tracing,
                        probe=probe if self.bus is None else None, broker_timeout_s=self.cfg.kafka.broker_timeout_s,
                        bootstrap=self.bootstrap, assignment_timeout_s=self.cfg.kafka.assignment_timeout_s,
                        leave_group=self.cfg.kafka.leave_group_on_close)
        consumer.subscribe(list(topics), listener=_Forget(source))
        return source

    def reader(self, bulk: bool = False) -> KafkaConsumer:
        """A consumer with no group: it never commits and reads whatever it is assigned. ``bulk``: each fetch
        may return up to ``fetch_max_bytes`` from one partition (a weights chunk topic), not one request's worth."""
        return self.consumer(None, bulk=bulk)

    def consumer(self, group_id: str | None, probe: ClientProbe | None = None, bulk: bool = False):
        """A raw consumer client (kafka-python's, or the bus's) for ``group_id``; the edge wraps it."""
        if self.bus is not None:
            from stream_rl.transport.memory import MemoryConsumer

            return MemoryConsumer(self.bus, group_id, self.cfg.kafka.max_poll_records)
        settings = consumer_settings(self.cfg.kafka, self.bootstrap, group_id, self.instance_id, probe)
        if bulk:
            settings["max_partition_fetch_bytes"] = settings["fetch_max_bytes"]
        return KafkaConsumer(**settings)


def _tp(tp: Any) -> TopicPartition:
    """kafka-python's partition type of a plain ``(topic, partition)`` pair (equal to it, and hashed alike)."""
    return tp if isinstance(tp, TopicPartition) else TopicPartition(*tp)


def partitions_of(consumer: KafkaConsumer, topic: str, timeout_s: float = 10.0) -> list[TopicPartition]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return [TopicPartition(topic, p) for p in sorted(parts)]
        time.sleep(0.1)
    raise KeyError(f"topic {topic} does not exist")


def committed_offsets(admin: KafkaAdminClient, group: str) -> dict[tuple[str, int], int]:
    """``{(topic, partition): offset}`` the consumer ``group`` committed, as the broker reports them (partitions
    without a commit are left out)."""
    found = admin.list_group_offsets({group: None}).get(group, {})
    return {(tp.topic, tp.partition): int(meta.offset) for tp, meta in found.items() if meta.offset >= 0}


def highwaters(consumer: KafkaConsumer, tps: Sequence[TopicPartition], timeout_s: float = 10.0,
               start: Mapping[TopicPartition, int | None] | None = None) -> dict[Any, int]:
    """High-water mark of each partition, taken from fetch responses (ListOffsets(latest) is wrong on tansu).

    Each partition is fetched from ``start[tp]`` when given and >= 0 (e.g. the previous mark, so a repeated
    measurement moves only the records added since), else from the beginning; nothing is consumed."""
    tps = [_tp(tp) for tp in tps]
    start = {_tp(tp): off for tp, off in (start or {}).items()}
    consumer.assign(list(tps))
    for tp in tps:
        offset = (start or {}).get(tp)
        if offset is None or offset < 0:
            consumer.seek_to_beginning(tp)
        else:
            consumer.seek(tp, offset)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        consumer.poll(timeout_ms=200, max_records=1, update_offsets=False)
        marks = {tp: consumer.highwater(tp) for tp in tps}
        if all(v is not None for v in marks.values()):
            return marks
    missing = [f"{tp.topic}[{tp.partition}]" for tp in tps if consumer.highwater(tp) is None]
    raise TimeoutError(f"no fetch response within {timeout_s}s for {', '.join(missing)}")


def read_range(consumer: KafkaConsumer, tp: TopicPartition, start: int, limit: int | None,
               timeout_s: float = 10.0) -> Iterator[Any]:
    """Raw records of one partition from ``start`` up to the high-water mark (or ``limit`` records).

    A batch the client cannot read (codec, corruption) comes out as one :class:`SkippedRecord` per offset with
    the reason, and the read goes on after it."""
    tp = _tp(tp)
    end = highwaters(consumer, [tp], timeout_s)[tp]
    consumer.assign([tp])
    consumer.seek(tp, max(start, 0))
    produced = 0
    deadline = time.monotonic() + timeout_s
    while consumer.position(tp) < end and (limit is None or produced < limit):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tp.topic}[{tp.partition}] stalled at offset {consumer.position(tp)} of {end}")
        try:
            fetched = consumer.poll(timeout_ms=500).get(tp, [])
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
