"""Topic naming and creation.

Consumes: a :class:`~stream_rl.config.TopicsConfig` and an admin client.
Produces: full topic names ``{prefix}.{run}.{logical}`` and the topics themselves with their partition counts.
Guarantees: ``ensure_topics`` is idempotent (an existing topic is left as it is, but a partition count that differs
from the config is reported as an error rather than ignored); errors other than "already exists" propagate.
"""

from __future__ import annotations

from dataclasses import dataclass

from stream_rl.config import TopicsConfig

LOGICAL_TOPICS = ("prompts", "rollouts", "scored", "weights", "dlq", "stale", "status", "alerts")


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

    def weights_chunks(self, version: int) -> str:
        return self.name(f"weights.v{version}")

    def __getattr__(self, item: str) -> str:
        if item in LOGICAL_TOPICS:
            return self.name(item)
        raise AttributeError(item)


def resolve_topic(names: TopicNames, topic: str) -> str:
    """A logical name (``rollouts``) or a full topic name, as the full name."""
    return names.name(topic) if topic in LOGICAL_TOPICS else topic


def ensure_topics(admin, cfg: TopicsConfig, logical: tuple[str, ...] = LOGICAL_TOPICS,
                  extra: dict[str, int] | None = None) -> dict[str, int]:
    """Create the run's topics that do not exist yet; return {full name: partitions}."""
    from kafka.admin import NewTopic

    names = TopicNames.from_config(cfg)
    wanted = {names.name(t): cfg.partitions.get(t, 1) for t in logical}
    wanted.update(extra or {})
    existing = set(admin.list_topics())
    missing = [NewTopic(name, count, cfg.replication_factor) for name, count in wanted.items()
               if name not in existing]
    if missing:
        _create(admin, missing)
    present = {name: count for name, count in wanted.items() if name in existing}
    if present:
        for desc in admin.describe_topics(list(present)):
            name = desc.get("name", desc.get("topic"))  # kafka-python 3 says "name"
            got = len(desc["partitions"])
            if got != present[name]:
                raise TopicError(f"topic {name} has {got} partitions, config wants {present[name]}: "
                                 "change topics.partitions or use a new topics.run")
    return wanted


def _create(admin, new_topics) -> None:
    from kafka.errors import TopicAlreadyExistsError

    for topic in new_topics:  # one by one, so a concurrent creator's win is not an error
        try:
            admin.create_topics([topic])
        except TopicAlreadyExistsError:
            pass
