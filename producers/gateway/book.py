"""The gateway's book of episodes: which are open, which ended and wait for their group, which are closed.

Consumes: the gateway topic's records in order (:class:`~schemas.GatewayCall`, :class:`~schemas.GatewayEpisode`),
live as they are acknowledged or replayed from the topic at start-up, each with where it lies.
Produces: the state a call or an end request is checked against, the episodes idle past the timeout, and the
groups ready to publish (pure: no Kafka, no clock of its own; not thread-safe, the gateway holds one lock).

An episode's life::

    calls (open) ──end──► ended ──(its group complete)──► published
         └──── idle > episode_timeout_s, or ended as failed ────► dead_lettered

Guarantees:
- The book after replaying the topic equals the book before the restart: every acknowledged call and state change
  is on the topic, so a restarted gateway loses no recorded call and re-opens exactly the open episodes (their
  idle clock runs from their last recorded call, wall time).
- A group (:func:`~producers.gateway.episodes.group_of`) is ready when ``group_size`` of its episodes are closed or
  ended and at least one ended; a group of dead-lettered episodes only is never published. A closed episode id
  takes no further call.
- :meth:`Book.counts` counts each episode once in its current state (a record replayed twice counts once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from producers.gateway.episodes import Ended, group_of, ordered_calls
from schemas import GatewayCall, GatewayEpisode


@dataclass
class Open:
    """An episode taking calls: its calls by index, where its first call lies, its last activity (Unix time)."""

    calls: dict[int, GatewayCall] = field(default_factory=dict)
    where: tuple[str, int, int] | None = None  # (topic, partition, offset) of its first call
    last_seen: float = 0.0


@dataclass
class Book:
    """Every episode the gateway topic holds, by state (see the module docstring)."""

    group_size: int
    open: dict[str, Open] = field(default_factory=dict)
    ended: dict[str, dict[str, Ended]] = field(default_factory=dict)  # group -> episode -> its calls and end
    closed: dict[str, str] = field(default_factory=dict)  # episode -> "dead_lettered" | "published"
    dead_in_group: dict[str, int] = field(default_factory=dict)
    published: int = 0  # episodes closed as published
    dead_lettered: int = 0  # episodes closed as dead-lettered

    def state(self, episode_id: str) -> str:
        """``new``, ``open``, ``ended``, ``dead_lettered`` or ``published``."""
        if episode_id in self.open:
            return "open"
        if episode_id in self.ended.get(group_of(episode_id), {}):
            return "ended"
        return self.closed.get(episode_id, "new")

    def next_index(self, episode_id: str) -> int:
        found = self.open.get(episode_id)
        return 0 if found is None else max(found.calls, default=-1) + 1

    def add_call(self, call: GatewayCall, where: tuple[str, int, int] | None) -> None:
        """Record an acknowledged call (a call already recorded, replayed twice, is kept once)."""
        if self.state(call.episode_id) not in ("new", "open"):
            return
        episode = self.open.setdefault(call.episode_id, Open())
        episode.calls.setdefault(call.call_index, call)
        if call.call_index == 0 and where is not None:
            episode.where = where
        episode.last_seen = max(episode.last_seen, float(call.created_at))

    def apply(self, record: GatewayEpisode) -> None:
        """Record an acknowledged change of an episode's state."""
        episode_id, group = record.episode_id, group_of(record.episode_id)
        if record.outcome == "ended":
            found = self.open.pop(episode_id, None)
            if found is not None:
                self.ended.setdefault(group, {})[episode_id] = Ended(episode_id, ordered_calls(found.calls), record)
        elif record.outcome == "dead_lettered":
            self.open.pop(episode_id, None)
            if self.closed.get(episode_id) != "dead_lettered":  # a record replayed twice counts once
                self.dead_in_group[group] = self.dead_in_group.get(group, 0) + 1
                self.dead_lettered += 1
            self.closed[episode_id] = "dead_lettered"
        else:  # published
            self.ended.get(group, {}).pop(episode_id, None)
            if not self.ended.get(group, True):
                del self.ended[group]
            self.published += self.closed.get(episode_id) != "published"
            self.closed[episode_id] = "published"

    def counts(self) -> dict[str, int]:
        """Episodes by state: ``open``, ``ended`` (waiting for their group), ``published``, ``dead_lettered``."""
        return {"open": len(self.open), "ended": sum(len(group) for group in self.ended.values()),
                "published": self.published, "dead_lettered": self.dead_lettered}

    def idle(self, now: float, timeout_s: float) -> list[str]:
        """Open episodes whose last call is older than ``timeout_s`` at ``now`` (Unix time)."""
        return [e for e, found in self.open.items() if now - found.last_seen > timeout_s]

    def ready(self, group: str) -> list[Ended] | None:
        """The ended episodes of ``group`` when it is complete (module guarantees), else None."""
        ended = self.ended.get(group, {})
        if not ended:
            return None
        size = 1 if next(iter(ended)) == group else self.group_size  # an id without '/' is a group of its own
        if len(ended) + self.dead_in_group.get(group, 0) >= size:
            return [ended[e] for e in sorted(ended)]
        return None

    def ready_groups(self) -> list[str]:
        return [group for group in sorted(self.ended) if self.ready(group) is not None]
