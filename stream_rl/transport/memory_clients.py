"""The consumer and admin clients of the in-process bus (:mod:`stream_rl.transport.memory`, whose docstring states
the contract).

Consumes: a :class:`~stream_rl.transport.memory.Bus`.
Produces: :class:`MemoryConsumer` (``KafkaConsumer``'s subscribe/assign, poll, seek, position, committed,
highwater, topics, pause/resume, commit, close) and :class:`MemoryAdmin` (list/create/describe topics and configs,
a group's committed offsets).
Guarantees: a member applies the group's newest assignment at ``poll`` (listener: revoked, then assigned); a commit
of a partition the group no longer gives this member raises ``CommitFailedError``; ``close`` leaves the group.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kafka.errors import (
    CommitFailedError,
    IllegalStateError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
)
from kafka.structs import OffsetAndMetadata, TopicPartition

from stream_rl.transport.reader import topic_partition

if TYPE_CHECKING:
    from stream_rl.transport.memory import Bus


class MemoryConsumer:
    """A consumer of a :class:`~stream_rl.transport.memory.Bus`, in a group (``group_id``) or group-less."""

    def __init__(self, bus_: Bus, group_id: str | None = None, max_poll_records: int = 500) -> None:
        self.bus = bus_
        self.group_id = group_id
        self.max_poll_records = max_poll_records
        self._topics: set[str] = set()
        self._listener = None
        self._assigned: set[TopicPartition] = set()
        self._generation: int | None = None  # the group generation of the applied assignment (subscribed)
        self._positions: dict[TopicPartition, int] = {}
        self._paused: set[TopicPartition] = set()
        self._closed = False

    # -- membership ------------------------------------------------------------------------------------------------

    def subscribe(self, topics: Iterable[str], listener=None) -> None:
        if self._assigned and self._generation is None:
            raise IllegalStateError("Subscription to topics, partitions and pattern are mutually exclusive")
        with self.bus.cond:
            self._topics, self._listener = set(topics), listener
            group = self.bus.group(self._group_required())
            if self not in group.members:
                group.members.append(self)
            self.bus.rebalance(group)

    def subscription(self) -> set[str] | None:
        return set(self._topics) or None

    def unsubscribe(self) -> None:
        with self.bus.cond:
            self._leave()
            self._assigned, self._positions, self._paused = set(), {}, set()

    def assign(self, partitions: Iterable[Any]) -> None:
        if self._topics:
            raise IllegalStateError("Subscription to topics, partitions and pattern are mutually exclusive")
        self._assigned = {topic_partition(tp) for tp in partitions}
        self._positions = {tp: off for tp, off in self._positions.items() if tp in self._assigned}
        self._paused &= self._assigned

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    def _leave(self) -> None:
        if self._topics and self.group_id is not None:
            group = self.bus.group(self.group_id)
            if self in group.members:
                group.members.remove(self)
                self.bus.rebalance(group)
        self._topics, self._generation = set(), None

    def _group_required(self) -> str:
        if self.group_id is None:
            raise IllegalStateError("a consumer with no group_id cannot subscribe or commit")
        return self.group_id

    def _apply_rebalance(self) -> None:
        """Take the group's newest assignment (caller holds the lock), telling the listener as kafka-python does."""
        if not self._topics:
            return
        group = self.bus.group(self.group_id)
        if self._generation == group.generation:
            return
        new = {tp for tp, member in group.owner.items() if member is self}
        revoked = self._assigned - new
        if self._listener is not None and revoked:
            self._listener.on_partitions_revoked(revoked)
        for tp in revoked:
            self._positions.pop(tp, None)
        self._paused &= new
        self._assigned, self._generation = new, group.generation
        if self._listener is not None:
            self._listener.on_partitions_assigned(new)

    # -- reading ---------------------------------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 0, max_records: int | None = None, update_offsets: bool = True
             ) -> dict[TopicPartition, list]:
        deadline = time.monotonic() + timeout_ms / 1000
        with self.bus.cond:
            while True:
                self._apply_rebalance()
                out = self._fetch(max_records or self.max_poll_records, update_offsets)
                left = deadline - time.monotonic()
                if out or left <= 0 or not update_offsets:  # a high-water probe (Reader.highwaters) never waits
                    return out
                self.bus.cond.wait(left)

    def _fetch(self, limit: int, update_offsets: bool) -> dict[TopicPartition, list]:
        out: dict[TopicPartition, list] = {}
        for tp in sorted(self._assigned - self._paused):
            if limit <= 0:
                break
            log = self.bus.partitions(tp.topic)[tp.partition]
            start = self.position(tp)
            records = log[start:start + limit]
            if records:
                out[tp] = records
                limit -= len(records)
                if update_offsets:
                    self._positions[tp] = start + len(records)
        return out

    def position(self, tp: Any) -> int:
        tp = topic_partition(tp)
        if tp not in self._assigned:
            raise IllegalStateError(f"No current assignment for partition {tp}")
        if tp not in self._positions:
            committed = self.committed(tp)
            self._positions[tp] = committed if committed is not None else 0  # auto_offset_reset=earliest
        return self._positions[tp]

    def seek(self, tp: Any, offset: int) -> None:
        tp = topic_partition(tp)
        if tp not in self._assigned:
            raise IllegalStateError(f"No current assignment for partition {tp}")
        self._positions[tp] = offset

    def seek_to_beginning(self, *partitions: Any) -> None:
        for tp in partitions or tuple(self._assigned):
            self.seek(tp, 0)

    def highwater(self, tp: Any) -> int | None:
        tp = topic_partition(tp)
        if tp not in self._assigned:
            return None
        with self.bus.cond:
            return len(self.bus.partitions(tp.topic)[tp.partition])

    def beginning_offsets(self, partitions: Iterable[Any]) -> dict[TopicPartition, int]:
        return {topic_partition(tp): 0 for tp in partitions}  # nothing is ever deleted from a memory log

    def topics(self) -> set[str]:
        with self.bus.cond:
            return set(self.bus.logs)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        with self.bus.cond:
            return set(range(len(self.bus.logs[topic]))) if topic in self.bus.logs else None

    def pause(self, *partitions: Any) -> None:
        self._paused |= {topic_partition(tp) for tp in partitions if topic_partition(tp) in self._assigned}

    def resume(self, *partitions: Any) -> None:
        self._paused -= {topic_partition(tp) for tp in partitions}

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    # -- offsets ---------------------------------------------------------------------------------------------------

    def committed(self, tp: Any, timeout_ms: int | None = None) -> int | None:
        if self.group_id is None:
            return None
        with self.bus.cond:
            return self.bus.group(self.group_id).committed.get(topic_partition(tp))

    def commit(self, offsets: dict[Any, Any] | None = None, timeout_ms: int | None = None) -> None:
        with self.bus.cond:
            group = self.bus.group(self._group_required())
            if offsets is None:
                offsets = {tp: self.position(tp) for tp in self._assigned}
            offsets = {topic_partition(tp): getattr(off, "offset", off) for tp, off in offsets.items()}
            if self._topics:
                lost = [tp for tp in offsets if group.owner.get(tp) is not self]
                if lost or self._generation != group.generation:
                    raise CommitFailedError(f"the group rebalanced: {sorted(lost)} no longer assigned here")
            elif group.members:
                raise CommitFailedError(f"group {self.group_id} has active members: a consumer with no "
                                        f"generation may not commit to it")
            group.committed.update(offsets)

    def close(self, autocommit: bool = False) -> None:
        with self.bus.cond:
            self._leave()
            self._closed = True


class MemoryAdmin:
    """``KafkaAdminClient``'s topic and group-offset queries on a :class:`~stream_rl.transport.memory.Bus`."""

    def __init__(self, bus_: Bus) -> None:
        self.bus = bus_

    def list_topics(self) -> list[str]:
        with self.bus.cond:
            return sorted(self.bus.logs)

    def create_topics(self, new_topics: Iterable[Any], timeout_ms: int | None = None) -> None:
        with self.bus.cond:
            for topic in new_topics:
                if topic.name in self.bus.logs:
                    raise TopicAlreadyExistsError(f"topic {topic.name} already exists")
                self.bus.logs[topic.name] = [[] for _ in range(max(1, topic.num_partitions))]
                self.bus.configs[topic.name] = dict(topic.topic_configs or {})

    def delete_topics(self, topics: Iterable[str], timeout_ms: int | None = None,
                      raise_errors: bool = True) -> dict[str, Any]:
        """Kafka's result shape: ``{"topics": [{"name", "error_code", "error_message"}]}`` (3: no such topic)."""
        out = []
        with self.bus.cond:
            for name in topics:
                missing = self.bus.logs.pop(name, None) is None
                self.bus.configs.pop(name, None)
                if missing and raise_errors:
                    raise UnknownTopicOrPartitionError(f"topic {name} does not exist")
                out.append({"name": name, "error_code": 3 if missing else 0,
                            "error_message": "This server does not host this topic-partition." if missing else None})
        return {"topics": out}

    def describe_topics(self, topics: Iterable[str]) -> list[dict[str, Any]]:
        with self.bus.cond:
            return [{"name": t, "partitions": [{"partition": p} for p in range(len(self.bus.partitions(t)))]}
                    for t in topics]

    def describe_configs(self, resources: Iterable[Any], config_filter: str = "all") -> dict[str, Any]:
        with self.bus.cond:
            found = {r.name: {k: {"value": v} for k, v in self.bus.configs.get(r.name, {}).items()}
                     for r in resources if r.name in self.bus.logs}
        return {"topic": found}

    def list_group_offsets(self, groups: dict[str, Any]) -> dict[str, dict[TopicPartition, OffsetAndMetadata]]:
        with self.bus.cond:
            return {g: {tp: OffsetAndMetadata(off, "", -1) for tp, off in self.bus.group(g).committed.items()}
                    for g in groups}

    def delete_groups(self, group_ids: Iterable[str]) -> dict[str, str]:
        """Forget the committed offsets of ``group_ids`` (Kafka's DeleteGroups; this bus keeps nothing else)."""
        with self.bus.cond:
            for group in group_ids:
                self.bus.group(group).committed.clear()
        return {group: "OK" for group in group_ids}

    def close(self) -> None:
        return None
