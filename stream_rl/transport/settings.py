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
- consumers never auto-create topics (a reader still assigned to a garbage-collected weights topic would
  otherwise re-create it); topics are created explicitly with their partition counts;
- SASL/SSL settings pass through; the password comes from its file or the environment, never from a log.
Nothing in the project calls ``end_offsets``, ``seek_to_end`` or ``offsets_for_times`` (wrong on tansu 0.6);
high-water marks come from fetch responses (``consumer.highwater``).
"""

from __future__ import annotations

from typing import Any

from stream_rl.config import KafkaConfig, read_secret


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


def _common(cfg: KafkaConfig, bootstrap: str, client_id: str | None) -> dict[str, Any]:
    return {
        "bootstrap_servers": bootstrap.split(","),
        "client_id": client_id or cfg.client_id,
        "request_timeout_ms": cfg.request_timeout_ms,
        **security_settings(cfg),
    }


def producer_settings(cfg: KafkaConfig, bootstrap: str, client_id: str | None = None) -> dict[str, Any]:
    return {
        **_common(cfg, bootstrap, client_id),
        "acks": "all" if cfg.acks == "all" else int(cfg.acks),
        "enable_idempotence": cfg.acks == "all",
        "max_request_size": cfg.max_request_size,
        "linger_ms": cfg.linger_ms,
        "retries": 5,
        "retry_backoff_ms": 200,
    }


def consumer_settings(cfg: KafkaConfig, bootstrap: str, group_id: str | None,
                      client_id: str | None = None) -> dict[str, Any]:
    return {
        **_common(cfg, bootstrap, client_id),
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "allow_auto_create_topics": False,  # a reader of a deleted topic must not re-create it
        "session_timeout_ms": cfg.session_timeout_ms,
        "heartbeat_interval_ms": cfg.heartbeat_interval_ms,
        "max_poll_records": cfg.max_poll_records,
        "max_partition_fetch_bytes": max(cfg.max_request_size, 1_048_576),
        "fetch_max_bytes": max(8 * cfg.max_request_size, 52_428_800),
    }


def admin_settings(cfg: KafkaConfig, bootstrap: str, client_id: str | None = None) -> dict[str, Any]:
    return _common(cfg, bootstrap, client_id)
