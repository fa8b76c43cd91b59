"""Cluster questions asked before or beside a run: is a broker there, which topics exist, with what configs.

Consumes: a bootstrap address (``host:port[,...]`` or ``memory://<name>``) and a
:class:`~stream_rl.config.KafkaConfig` for the security settings.
Produces: :func:`admin_client` (kafka-python's ``KafkaAdminClient`` or the in-process bus's), reachability checks
(:func:`answers_metadata`, :func:`reaches_broker`, :func:`metadata_error`) and :func:`describe_topics`.
Guarantees: kafka-python's errors stay here: a failed topic query raises :class:`AdminError` carrying the
client's message; the checks return a boolean or the error's type name. An in-process bus always answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from stream_rl.transport.memory import bus, memory_name


class AdminError(RuntimeError):
    """A topic or config query the cluster did not answer (the message is the client's)."""


def admin_client(kafka_cfg, bootstrap: str, client_id: str | None = None, probe: bool = False, **extra: Any):
    """An admin client for ``bootstrap`` (settings from :func:`~stream_rl.transport.settings.admin_settings`;
    ``extra`` overrides them)."""
    name = memory_name(bootstrap)
    if name is not None:
        from stream_rl.transport.memory import MemoryAdmin

        return MemoryAdmin(bus(name))
    from kafka import KafkaAdminClient

    from stream_rl.transport.settings import admin_settings

    return KafkaAdminClient(**{**admin_settings(kafka_cfg, bootstrap, client_id, probe=probe), **extra})


def answers_metadata(bootstrap: str, timeout_s: float = 2.0) -> bool:
    """True when the broker at ``bootstrap`` answers a Metadata request within ``timeout_s`` (plaintext)."""
    if memory_name(bootstrap) is not None:
        return True
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000),
                                 bootstrap_timeout_ms=int(timeout_s * 1000))
    except (KafkaError, OSError, ValueError):
        return False
    try:
        admin.list_topics()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


def reaches_broker(kafka_cfg, bootstrap: str, client_id: str) -> bool:
    """Whether an admin client bootstraps from ``bootstrap`` within ``kafka.connect_timeout_s`` (the probe a
    command runs before it starts)."""
    from kafka.errors import KafkaTimeoutError

    try:
        admin = admin_client(kafka_cfg, bootstrap, client_id, probe=True)
    except KafkaTimeoutError:  # kafka-python 3: "Unable to bootstrap from [...]" after bootstrap_timeout_ms
        return False
    admin.close()
    return True


def metadata_error(kafka_cfg, bootstrap: str, client_id: str, timeout_s: float) -> str | None:
    """None when a Metadata round trip with the configured SASL/SSL settings succeeds within ``timeout_s``,
    else the error's type name."""
    from kafka.errors import KafkaError

    try:
        with closing(admin_client(kafka_cfg, bootstrap, client_id, probe=True,
                                  bootstrap_timeout_ms=int(timeout_s * 1000))) as admin:
            admin.list_topics()
    except (KafkaError, OSError, ValueError) as exc:
        return type(exc).__name__
    return None


@dataclass(frozen=True)
class TopicFacts:
    """What the cluster says of some topics: those present, their partition counts and their configs."""

    present: list[str]
    counts: dict[str, int]
    configs: dict[str, dict[str, str]]


def describe_topics(kafka_cfg, bootstrap: str, client_id: str, wanted: Sequence[str]) -> TopicFacts:
    """Which of ``wanted`` exist, their partition counts and configs (``{}`` when the broker reports none);
    raises :class:`AdminError` with the client's message when listing fails."""
    from kafka.errors import KafkaError

    try:
        with closing(admin_client(kafka_cfg, bootstrap, client_id, probe=True)) as admin:
            present = sorted(set(admin.list_topics()) & set(wanted))
            counts = {d.get("name", d.get("topic")): len(d["partitions"])
                      for d in (admin.describe_topics(present) if present else [])}
            configs = topic_configs_of(admin, present) if present else {}
    except KafkaError as exc:
        raise AdminError(str(exc)) from exc
    return TopicFacts(present, counts, configs)


def topic_configs_of(admin, topics: Sequence[str]) -> dict[str, dict[str, str]]:
    """{topic: {config name: value}} from DescribeConfigs; {} for a broker that does not report them."""
    from kafka.admin import ConfigResource, ConfigResourceType
    from kafka.errors import KafkaError

    try:
        answer = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t) for t in topics],
                                        config_filter="all")
    except KafkaError:
        return {}
    return {topic: {k: v.get("value") for k, v in entries.items()}
            for topic, entries in answer.get("topic", {}).items()}
