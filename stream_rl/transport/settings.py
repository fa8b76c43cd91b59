"""Client settings for kafka-python: the ONE place where broker quirks are worked around.

Consumes: a :class:`~stream_rl.config.KafkaConfig` and a resolved bootstrap address.
Produces: keyword dicts for ``KafkaProducer``, ``KafkaConsumer`` and ``KafkaAdminClient``.
Guarantees:
- offsets are committed manually (``enable_auto_commit=False``) and a group with no committed offset starts at the
  earliest record (never ``latest``: tansu 0.6 answers ListOffsets(latest) wrongly, and a new group must not skip
  records anyway);
- short session/heartbeat timeouts, since group joins are held for ``session_timeout_ms / 2``;
- ``max_request_size`` stays at Apache Kafka's 1 MiB default so local runs fail where production would;
- producers are idempotent with ``acks=all`` (kafka-python's default, set explicitly);
- no client ever auto-creates a topic: producers, consumers and admin clients get a network client
  (:class:`ClientProbe`) whose metadata requests say ``allow_auto_topic_creation=false``. kafka-python 3.0.12
  accepts ``allow_auto_create_topics`` but never hands it to the cluster metadata that builds those requests, so
  without this every producer's periodic metadata refresh re-created deleted topics (weights chunk topics after
  garbage collection, ``status`` with the broker's default partition count after a broker lost its topics).
  Topics are created explicitly (``stream-rl topics create``) with their partition counts;
- producers refresh metadata every 10 s, so sends to a topic deleted under them fail (``TopicError``) within
  seconds; tansu 0.6 acknowledges and drops a produce to a deleted topic, Apache Kafka rejects it;
- a producer blocks at most ``kafka.broker_timeout_s`` in ``send`` (metadata of a missing topic, a full buffer)
  and reports a send as failed after at most that long (``delivery_timeout_ms``), so a vanished broker or a
  missing topic becomes an error (see :mod:`stream_rl.transport.edge`), never a hang;
- the probe a command runs before it starts (``admin_settings(..., probe=True)``) gives up reaching a broker
  after ``kafka.connect_timeout_s`` (at most ``broker_timeout_s``; kafka-python's default is 30 s), so a command
  pointed at no broker fails fast; every other client (a role's producer, consumer and admin queries) keeps
  re-bootstrapping for ``kafka.broker_timeout_s``, so a broker that comes back within that loses nothing;
- SASL/SSL settings pass through; the password comes from its file or the environment, never from a log.
Nothing in the project calls ``end_offsets``, ``seek_to_end`` or ``offsets_for_times`` (wrong on tansu 0.6);
high-water marks come from fetch responses (``consumer.highwater``).
"""

from __future__ import annotations

import time
from typing import Any

from kafka.net.compat import KafkaNetClient

from stream_rl.config.sections import KafkaConfig, read_secret

PRODUCER_METADATA_MAX_AGE_MS = 10_000
"""Producers re-read topic metadata this often (kafka-python's default: 5 min), so a topic deleted under them is
noticed within seconds: tansu 0.6 acknowledges a produce to a deleted topic and drops it (measured)."""


class ClientProbe:
    """The ``kafka_client`` factory of one kafka-python client: builds its network client with automatic topic
    creation off, and tells when that client last heard from a broker (the edge's liveness signal)."""

    def __init__(self) -> None:
        self.client: KafkaNetClient | None = None

    def __call__(self, **configs: Any) -> KafkaNetClient:
        client = KafkaNetClient(**configs)
        client.cluster.config["allow_auto_create_topics"] = False  # see the module docstring
        self.client = client
        return client

    def last_heard(self) -> float | None:
        """``time.monotonic()`` of the last bytes read from any connected broker, None if none is connected."""
        if self.client is None:
            return None
        conns = list(self.client._manager._conns.values())  # kafka-python 3.0.12 connection table
        reads = [c.transport.last_read for c in conns if c.connected and c.transport is not None]
        return max(reads, default=None)

    def heard_within(self, seconds: float) -> bool:
        heard = self.last_heard()
        return heard is not None and time.monotonic() - heard <= seconds

    def knows_topic(self, topic: str) -> bool:
        """Whether the client's metadata lists ``topic`` (after a refresh that reached a broker)."""
        return self.client is not None and self.client.cluster.partitions_for_topic(topic) is not None


def security_settings(cfg: KafkaConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"security_protocol": cfg.security_protocol}
    if cfg.security_protocol.startswith("SASL"):
        out["sasl_mechanism"] = cfg.sasl_mechanism or "PLAIN"
        if cfg.sasl_username is not None:
            out["sasl_plain_username"] = cfg.sasl_username
        password = read_secret(cfg.sasl_password, cfg.sasl_password_file)
        if password is not None:
            out["sasl_plain_password"] = password
    if cfg.security_protocol.endswith("SSL"):
        out["ssl_check_hostname"] = cfg.ssl_check_hostname
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            value = getattr(cfg, name)
            if value is not None:
                out[name] = str(value)
    return out


def connect_timeout_s(cfg: KafkaConfig) -> float:
    """How long a new client tries to reach a broker: ``connect_timeout_s``, at most ``broker_timeout_s``."""
    return min(cfg.connect_timeout_s, cfg.broker_timeout_s)


def _common(cfg: KafkaConfig, bootstrap: str, client_id: str | None,
            probe: ClientProbe | None = None, bootstrap_timeout_s: float | None = None) -> dict[str, Any]:
    return {
        "bootstrap_servers": bootstrap.split(","),
        "client_id": client_id or cfg.client_id,
        "request_timeout_ms": cfg.request_timeout_ms,
        "bootstrap_timeout_ms": int((bootstrap_timeout_s or cfg.broker_timeout_s) * 1000),
        "kafka_client": probe if probe is not None else ClientProbe(),
        **security_settings(cfg),
    }


DEFAULT_BATCH_SIZE = 768 << 10
"""Producer batch bytes per partition when ``kafka.batch_size`` is unset (capped at ``max_request_size``): a few
dozen ~26 kB rollout records per request instead of kafka-python's 16 KiB, which sent each record alone."""


def producer_settings(cfg: KafkaConfig, bootstrap: str, client_id: str | None = None,
                      probe: ClientProbe | None = None) -> dict[str, Any]:
    bound_ms = int(cfg.broker_timeout_s * 1000)
    return {
        **_common(cfg, bootstrap, client_id, probe),
        "allow_auto_create_topics": False,
        "metadata_max_age_ms": PRODUCER_METADATA_MAX_AGE_MS,
        "max_block_ms": bound_ms,
        "delivery_timeout_ms": max(bound_ms, cfg.request_timeout_ms + cfg.linger_ms),
        "acks": "all" if cfg.acks == "all" else int(cfg.acks),
        "enable_idempotence": cfg.acks == "all",
        "max_request_size": cfg.max_request_size,
        "linger_ms": cfg.linger_ms,
        "compression_type": None if cfg.compression == "none" else cfg.compression,
        "batch_size": cfg.batch_size or min(DEFAULT_BATCH_SIZE, cfg.max_request_size),
        "retries": 5,
        "retry_backoff_ms": 200,
    }


def consumer_settings(cfg: KafkaConfig, bootstrap: str, group_id: str | None,
                      client_id: str | None = None, probe: ClientProbe | None = None) -> dict[str, Any]:
    return {
        **_common(cfg, bootstrap, client_id, probe),
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "allow_auto_create_topics": False,  # a reader of a deleted topic must not re-create it
        "session_timeout_ms": cfg.session_timeout_ms,
        "heartbeat_interval_ms": cfg.heartbeat_interval_ms,
        "max_poll_records": cfg.max_poll_records,
        "fetch_max_wait_ms": cfg.fetch_max_wait_ms,
        "max_partition_fetch_bytes": max(cfg.max_request_size, 1_048_576),
        "fetch_max_bytes": max(8 * cfg.max_request_size, 52_428_800),
    }


def admin_settings(cfg: KafkaConfig, bootstrap: str, client_id: str | None = None,
                   probe: bool = False) -> dict[str, Any]:
    """An admin client. ``probe``: a reachability check before a command starts, which gives up after
    ``connect_timeout_s``; otherwise (a role's topic and lag queries) it re-bootstraps for ``broker_timeout_s``."""
    return _common(cfg, bootstrap, client_id, bootstrap_timeout_s=connect_timeout_s(cfg) if probe else None)
