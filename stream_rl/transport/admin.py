"""Cluster questions asked before or beside a run: is a broker there, which topics exist, with what configs, what
a consumer group committed; and the topic creation and deletion a run needs.

Consumes: a bootstrap address (``host:port[,...]`` or ``memory://<name>``) and a
:class:`~stream_rl.config.KafkaConfig` for the security settings.
Produces: :class:`Admin` (what ``Transport.admin()`` hands out: topic names, ``(topic, partition)`` pairs and
ints, never a kafka-python object), reachability checks (:func:`answers_metadata`, :func:`reaches_broker`,
:func:`metadata_error`) and :func:`describe_topics`; :func:`admin_client`, the raw client an :class:`Admin` wraps
(kafka-python's ``KafkaAdminClient`` or the in-process bus's), for this package only.
Guarantees: a failed topic query of :func:`describe_topics` raises :class:`AdminError` carrying the client's
message; a topic the broker refuses to delete raises :class:`TopicDeletionError` with its error code; the checks
return a boolean or the error's type name. An in-process bus always answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from stream_rl.transport.memory import bus, memory_name


class AdminError(RuntimeError):
    """A topic or config query the cluster did not answer (the message is the client's)."""


UNKNOWN_TOPIC = 3
"""Kafka's error code UNKNOWN_TOPIC_OR_PARTITION."""


class TopicDeletionError(AdminError):
    """The broker refused to delete ``topic``: its error ``code`` and ``error_message``."""

    def __init__(self, topic: str, code: int, error_message: str | None):
        super().__init__(f"deleting topic {topic} failed: error {code} {error_message}")
        self.topic, self.code, self.error_message = topic, code, error_message


class GroupDeletionError(AdminError):
    """The broker refused to delete a consumer group."""


_GROUP_GONE = ("OK", "NoError", "GroupIdNotFound")
"""Outcomes of a group deletion that leave the group gone (kafka-python reports a string or an error class)."""


class Admin:
    """Topic and consumer-group questions to one cluster, in plain Python: topic names, ``(topic, partition)``
    pairs and ints. Wraps kafka-python's ``KafkaAdminClient`` or the in-process bus's admin; a context manager
    (``close`` on exit). The client's errors propagate as they are, but for :meth:`delete_topics`'."""

    def __init__(self, client: Any):
        self._client = client

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def list_topics(self) -> set[str]:
        """Every topic name of the cluster."""
        return set(self._client.list_topics())

    def describe_topics(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """``[{"name": topic, "partitions": [partition ids]}]`` of ``names`` as the cluster reports them."""
        out = []
        for desc in self._client.describe_topics(list(names)):
            parts = [p.get("partition_index", p.get("partition")) for p in desc["partitions"]]
            out.append({"name": desc.get("name", desc.get("topic")), "partitions": parts})  # kafka-python 3: "name"
        return out

    def partition_counts(self, names: Sequence[str]) -> dict[str, int]:
        """``{topic: partition count}`` of ``names``."""
        return {d["name"]: len(d["partitions"]) for d in self.describe_topics(names)}

    def create_topic(self, name: str, partitions: int, replication_factor: int,
                     configs: dict[str, str] | None = None) -> bool:
        """Create one topic; False when it exists already (a concurrent creator won), other errors propagate."""
        from kafka.admin import NewTopic
        from kafka.errors import TopicAlreadyExistsError

        try:
            self._client.create_topics([NewTopic(name, partitions, replication_factor, topic_configs=configs or {})])
        except TopicAlreadyExistsError:
            return False
        return True

    def delete_topics(self, names: Iterable[str], timeout_s: float | None = None, missing_ok: bool = False) -> None:
        """Delete ``names``; raise :class:`TopicDeletionError` for the first one the broker refused (one that does
        not exist only unless ``missing_ok``)."""
        names = list(names)
        if not names:
            return
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        result = self._client.delete_topics(names, timeout_ms=timeout_ms, raise_errors=False)
        for item in result.get("topics", []):
            code = item.get("error_code", 0)
            if code != 0 and not (missing_ok and code == UNKNOWN_TOPIC):
                raise TopicDeletionError(item.get("name"), code, item.get("error_message"))

    def delete_groups(self, groups: Iterable[str]) -> None:
        """Delete consumer ``groups`` with their committed offsets (DeleteGroups; one that does not exist is no
        error); raise :class:`GroupDeletionError` naming the first the broker refused."""
        groups = list(groups)
        if not groups:
            return
        for group, outcome in dict(self._client.delete_groups(groups)).items():
            if outcome is not None and not any(word in str(outcome) for word in _GROUP_GONE):
                raise GroupDeletionError(f"the broker refused to delete consumer group {group}: {outcome}")

    def topic_configs(self, names: Sequence[str]) -> dict[str, dict[str, str | None]]:
        """``{topic: {config name: value}}`` from DescribeConfigs (every config, defaults included: tansu reports
        topic configs set at creation with source DEFAULT_CONFIG)."""
        from kafka.admin import ConfigResource, ConfigResourceType

        answer = self._client.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t) for t in names],
                                               config_filter="all")
        return {topic: {k: v.get("value") for k, v in entries.items()}
                for topic, entries in answer.get("topic", {}).items()}

    def group_offsets(self, groups: Iterable[str]) -> dict[str, dict[tuple[str, int], int]]:
        """``{group: {(topic, partition): offset}}`` each consumer group committed, as the broker reports them
        (partitions without a commit are left out); one request for all groups."""
        found = self._client.list_group_offsets(list(groups))
        return {group: {(tp.topic, tp.partition): int(meta.offset) for tp, meta in offsets.items()
                        if meta.offset >= 0}
                for group, offsets in found.items()}

    def committed_offsets(self, group: str) -> dict[tuple[str, int], int]:
        """``{(topic, partition): offset}`` the consumer ``group`` committed (see :meth:`group_offsets`)."""
        return self.group_offsets([group]).get(group, {})


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
        with Admin(admin_client(kafka_cfg, bootstrap, client_id, probe=True)) as admin:
            present = sorted(admin.list_topics() & set(wanted))
            counts = admin.partition_counts(present) if present else {}
            configs = topic_configs_of(admin, present) if present else {}
    except KafkaError as exc:
        raise AdminError(str(exc)) from exc
    return TopicFacts(present, counts, configs)


def topic_configs_of(admin: Admin, topics: Sequence[str]) -> dict[str, dict[str, str | None]]:
    """{topic: {config name: value}} from DescribeConfigs; {} for a broker that does not report them."""
    from kafka.errors import KafkaError

    try:
        return admin.topic_configs(topics)
    except KafkaError:
        return {}
