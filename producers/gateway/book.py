"""The gateway's book of episodes: which are open, which ended and wait for their group, which are closed.

Consumes: the gateway topic's records in order (:class:`~schemas.GatewayCall`, :class:`~schemas.GatewayEpisode`),
live as they are acknowledged or replayed from the topic at start-up, each with where it lies.
Produces: the state a call or an end request is checked against, the episodes idle past the timeout, and the
groups ready to publish (pure: no Kafka, no clock of its own; not thread-safe, the gateway holds one lock).

An episode's life::

    calls (open) ──end──► ended ──(its group complete)──► published
         └──── idle > episode_timeout_s, or ended as failed ────► dead_lettered
                                   ended as failed with refill ──► dead_lettered, refilled (not counted)
                     └── no new member of its group for episode_timeout_s ──► dead_lettered (counted)

Guarantees:
- The book after replaying the topic equals the book before the restart: every acknowledged call and state change
  is on the topic, so a restarted gateway loses no recorded call and re-opens exactly the open episodes (their
  idle clock runs from their last recorded call, wall time).
- A group (:func:`~producers.gateway.episodes.group_of`) is ready when ``group_size`` of its episodes are closed or
  ended and at least one ended; a group of dead-lettered episodes only is never published. A closed episode id
  takes no further call.
- A refilled episode (dead-lettered with ``refill``: its agent plays another episode of the group in its place) is
  not one of those ``group_size``; :meth:`Book.members` counts the group's other episodes, so an agent (the driver)
  knows how many replacements are still owed. When no episode of its group is open and the group saw nothing for
  the timeout, :meth:`Book.expired_refills` names it, and its second ``dead_lettered`` record makes it count: a
  replacement that never comes cannot hold a group back for ever.
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
    dead_in_group: dict[str, int] = field(default_factory=dict)  # dead-lettered episodes counted in their group
    seen: dict[str, set[str]] = field(default_factory=dict)  # group -> every episode of it the topic holds
    replaced: dict[str, int] = field(default_factory=dict)  # group -> its refilled episodes not counted in it
    refilled: dict[str, dict[str, int]] = field(default_factory=dict)  # group -> refilled episode -> its calls, while
    # the group still owes replacements
    last_seen: dict[str, float] = field(default_factory=dict)  # group -> Unix time of its last record
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
        self._saw(call.episode_id, float(call.created_at))
        self._settle(group_of(call.episode_id))
        episode = self.open.setdefault(call.episode_id, Open())
        episode.calls.setdefault(call.call_index, call)
        if call.call_index == 0 and where is not None:
            episode.where = where
        episode.last_seen = max(episode.last_seen, float(call.created_at))

    def apply(self, record: GatewayEpisode) -> None:
        """Record an acknowledged change of an episode's state."""
        episode_id, group = record.episode_id, group_of(record.episode_id)
        self._saw(episode_id, float(record.created_at))
        if record.outcome == "ended":
            found = self.open.pop(episode_id, None)
            if found is not None:
                self.ended.setdefault(group, {})[episode_id] = Ended(episode_id, ordered_calls(found.calls), record)
        elif record.outcome == "dead_lettered":
            self._dead(record, group)
            self._settle(group)
        else:  # published
            self.ended.get(group, {}).pop(episode_id, None)
            if not self.ended.get(group, True):
                del self.ended[group]
            self.published += self.closed.get(episode_id) != "published"
            self.closed[episode_id] = "published"

    def _saw(self, episode_id: str, when: float) -> None:
        group = group_of(episode_id)
        self.seen.setdefault(group, set()).add(episode_id)
        self.last_seen[group] = max(self.last_seen.get(group, 0.0), when)

    def _dead(self, record: GatewayEpisode, group: str) -> None:
        """A ``dead_lettered`` record: counted in its group unless refilled; a second record of a refilled episode
        (its refill expired) counts it then. A record replayed twice counts once."""
        episode_id = record.episode_id
        self.open.pop(episode_id, None)
        known = self.closed.get(episode_id) == "dead_lettered"
        self.dead_lettered += not known
        self.closed[episode_id] = "dead_lettered"
        waiting = self.refilled.setdefault(group, {})
        if record.refill:
            if not known:
                waiting[episode_id] = int(record.calls)
                self.replaced[group] = self.replaced.get(group, 0) + 1
        elif not known or waiting.pop(episode_id, None) is not None:  # new, or a refill that expired
            self.dead_in_group[group] = self.dead_in_group.get(group, 0) + 1
            if known:
                self.replaced[group] -= 1
        if not waiting:
            del self.refilled[group]

    def _settle(self, group: str) -> None:
        """A group whose members fill its size owes no replacement any more."""
        if group in self.refilled and self.members(group) >= self.group_size:
            del self.refilled[group]

    def members(self, group: str) -> int:
        """The episodes of ``group`` that count toward its size: every one the topic holds but the refilled ones
        (open, ended, published and counted dead-lettered ones)."""
        return len(self.seen.get(group, ())) - self.replaced.get(group, 0)

    def waiting_refills(self, group: str) -> int:
        """Refilled episodes of ``group`` whose replacements it still owes (0 once its members fill its size)."""
        return len(self.refilled.get(group, {}))

    def expired_refills(self, now: float, timeout_s: float) -> list[tuple[str, int]]:
        """``(episode, calls)`` of the refilled episodes whose group has no open episode and saw no record for
        more than ``timeout_s`` at ``now`` (Unix time): their replacements are not coming."""
        out = []
        for group, waiting in sorted(self.refilled.items()):
            if now - self.last_seen.get(group, 0.0) <= timeout_s:
                continue
            if any(episode in self.open for episode in self.seen.get(group, ())):
                continue
            out.extend(sorted(waiting.items()))
        return out

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
