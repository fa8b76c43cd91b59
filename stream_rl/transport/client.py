"""Builds the transport edge for a role from the config, and reads topics without a consumer group.

Consumes: a :class:`~stream_rl.config.SharedConfig`.
Produces: :class:`~stream_rl.transport.edge.Sink` / :class:`~stream_rl.transport.edge.Source` objects, an
:class:`~stream_rl.transport.admin.Admin` (plain topic names, pairs and ints), and group-less
:class:`~stream_rl.transport.reader.Reader` objects for replay, topic listing and lag (high-water marks from fetch
responses).
Guarantees: every client gets its settings from :mod:`stream_rl.transport.settings`; group-less reads never commit.
``kafka.bootstrap_servers = "memory://<name>"`` builds the clients of the in-process bus of that name instead
(:mod:`stream_rl.transport.memory`, same contract, no broker).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Sequence

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer

from stream_rl.broker import resolve_bootstrap
from stream_rl.config.shared import SharedConfig
from stream_rl.transport.admin import Admin, admin_client
from stream_rl.transport.edge import Sink, Source, forget_partitions
from stream_rl.transport.reader import Reader
from stream_rl.transport.settings import ClientProbe, consumer_settings, producer_settings
from stream_rl.transport.topics import TopicNames, ensure_topics
from stream_rl.transport.tracing import Tracing


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

    def admin(self) -> Admin:
        """Topic and consumer-group questions (list, create, delete, configs, committed offsets) in plain Python;
        close it, or use it as a context manager."""
        return Admin(admin_client(self.cfg.kafka, self.bootstrap, self.instance_id))

    def ensure_topics(self, extra: dict[str, int] | None = None) -> dict[str, int]:
        with self.admin() as admin:
            return ensure_topics(admin, self.cfg.topics, extra=extra)

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
               sink: Sink, *, keep_rejections: bool = False, pause_when: Callable[[], bool] | None = None) -> Source:
        """A group consumer on ``topics`` (full names) whose invalid records go to the run's DLQ via ``sink``;
        ``keep_rejections`` and ``pause_when`` configure the edge (:class:`~stream_rl.transport.edge.Source`)."""
        probe = ClientProbe()
        consumer = self.consumer(group_id, probe)
        source = Source(consumer, sink, self.names.dlq, expected_kind, self.instance_id, self.tracing,
                        probe=probe if self.bus is None else None, broker_timeout_s=self.cfg.kafka.broker_timeout_s,
                        bootstrap=self.bootstrap, assignment_timeout_s=self.cfg.kafka.assignment_timeout_s,
                        leave_group=self.cfg.kafka.leave_group_on_close, keep_rejections=keep_rejections,
                        pause_when=pause_when)
        consumer.subscribe(list(topics), listener=_Forget(source))
        return source

    def reader(self, bulk: bool = False) -> Reader:
        """A :class:`~stream_rl.transport.reader.Reader`: a consumer with no group, which never commits and reads
        what it is told to, in plain ``(topic, partition)`` pairs. ``bulk``: each fetch may return up to
        ``fetch_max_bytes`` from one partition (a weights chunk topic), not one request's worth."""
        return Reader(self.consumer(None, bulk=bulk))

    def consumer(self, group_id: str | None, probe: ClientProbe | None = None, bulk: bool = False):
        """A raw consumer client (kafka-python's, or the bus's) for ``group_id``; the edge wraps it."""
        if self.bus is not None:
            from stream_rl.transport.memory import MemoryConsumer

            return MemoryConsumer(self.bus, group_id, self.cfg.kafka.max_poll_records)
        settings = consumer_settings(self.cfg.kafka, self.bootstrap, group_id, self.instance_id, probe)
        if bulk:
            settings["max_partition_fetch_bytes"] = settings["fetch_max_bytes"]
        return KafkaConsumer(**settings)
