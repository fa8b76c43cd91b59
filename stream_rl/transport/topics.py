"""Topic naming and creation.

Consumes: a :class:`~stream_rl.config.TopicsConfig` and an :class:`~stream_rl.transport.admin.Admin`.
Produces: full topic names ``{prefix}.{run}.{logical}`` and the topics themselves with their partition counts and
their ``retention.ms`` topic config (``topics.retention_ms``; the per-version weights chunk topics use the
``weights_chunks`` entry).
Guarantees: ``ensure_topics`` is idempotent (an existing topic is left as it is, but a partition count that differs
from the config is reported as an error rather than ignored; retention is applied at creation only, an existing
topic keeps its own); errors other than "already exists" propagate. The local broker (tansu 0.6.0) stores and
reports ``retention.ms`` but does not delete expired records (measured); Apache Kafka enforces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stream_rl.config.sections import TopicsConfig

if TYPE_CHECKING:
    from stream_rl.transport.admin import Admin

LOGICAL_TOPICS = ("prompts", "rollouts", "scored", "weights", "dlq", "stale", "status", "alerts", "evals", "partials",
                  "gateway")
"""The run's topics ``{prefix}.{run}.<logical>``: created by every role, listed by ``stream-rl status`` (partitions
and lag), checked by ``doctor``, deleted with the run, and given ``topics.retention_ms`` at creation."""

CONSUMER_GROUPS = {"producers": "prompts", "scorers": "rollouts", "trainer": "scored"}
"""The run's consumer groups ``{prefix}.{run}.<name>`` and the logical topic each consumes: the one place the
roles (producers/role.py, consumers/scorer/scorer.py, consumers/trainer/trainer.py) and ``stream-rl status`` take them from."""


class TopicError(RuntimeError):
    """A topic is missing or configured differently from what the run needs."""


@dataclass(frozen=True)
class TopicNames:
    """Full names of a run's topics; ``weights_chunks(v)`` names the per-version chunk topic."""

    prefix: str
    run: str

    @classmethod
    def from_config(cls, cfg: TopicsConfig) -> TopicNames:
        return cls(cfg.prefix, cfg.run)

    def name(self, logical: str) -> str:
        return f"{self.prefix}.{self.run}.{logical}"

    def logical(self, full: str) -> str | None:
        head = f"{self.prefix}.{self.run}."
        return full[len(head):] if full.startswith(head) else None

    def group(self, name: str) -> str:
        """The full consumer-group name ``{prefix}.{run}.{name}`` of one of :data:`CONSUMER_GROUPS`."""
        if name not in CONSUMER_GROUPS:
            raise ValueError(f"unknown consumer group {name!r}; the run's groups are {sorted(CONSUMER_GROUPS)}")
        return f"{self.prefix}.{self.run}.{name}"

    def weights_chunks(self, version: int, delta: bool = False) -> str:
        """The chunk topic of ``version``: ``weights.v{N}`` for a full payload, ``weights.v{N}.delta`` for a
        delta (the name says which, so garbage collection can keep what a delta chain needs)."""
        return self.name(f"weights.v{version}.delta" if delta else f"weights.v{version}")

    def __getattr__(self, item: str) -> str:
        if item in LOGICAL_TOPICS:
            return self.name(item)
        raise AttributeError(item)


def resolve_topic(names: TopicNames, topic: str) -> str:
    """A logical name (``rollouts``) or a full topic name, as the full name."""
    return names.name(topic) if topic in LOGICAL_TOPICS else topic


def retention_key(names: TopicNames, full: str) -> str | None:
    """The ``topics.retention_ms`` key of a full topic name (``weights_chunks`` for ``...weights.v12`` and
    ``...weights.v12.delta``)."""
    logical = names.logical(full)
    if logical is None:
        return None
    head, _, version = logical.removesuffix(".delta").rpartition(".v")
    return "weights_chunks" if head == "weights" and version.isdigit() else logical


def topic_configs(cfg: TopicsConfig, full: str) -> dict[str, str]:
    """Topic configs to create ``full`` with: ``{"retention.ms": ...}`` when the config names its topic."""
    key = retention_key(TopicNames.from_config(cfg), full)
    if key is None or key not in cfg.retention_ms:
        return {}
    return {"retention.ms": str(cfg.retention_ms[key])}


def describe_retention(admin: Admin, topics: list[str]) -> dict[str, int | None]:
    """``retention.ms`` of each topic as the broker reports it (None when it reports none)."""
    found = admin.topic_configs(topics)
    out = {}
    for topic in topics:
        value = found.get(topic, {}).get("retention.ms")
        out[topic] = int(value) if value is not None else None
    return out


def ensure_topics(admin: Admin, cfg: TopicsConfig, logical: tuple[str, ...] = LOGICAL_TOPICS,
                  extra: dict[str, int] | None = None) -> dict[str, int]:
    """Create the run's topics that do not exist yet; return {full name: partitions}."""
    names = TopicNames.from_config(cfg)
    wanted = {names.name(t): cfg.partitions.get(t, 1) for t in logical}
    wanted.update(extra or {})
    existing = admin.list_topics()
    for name, count in wanted.items():  # one by one, so a concurrent creator's win is not an error
        if name not in existing:
            admin.create_topic(name, count, cfg.replication_factor, topic_configs(cfg, name))
    present = {name: count for name, count in wanted.items() if name in existing}
    if present:
        for name, got in admin.partition_counts(list(present)).items():
            if got != present[name]:
                raise TopicError(f"topic {name} has {got} partitions, config wants {present[name]}: "
                                 "change topics.partitions or use a new topics.run")
    return wanted
