"""Group assembly for the trainer: whole groups, deduplication by rollout id, the staleness bound, safe offsets.

Consumes: scored-rollout records (anything with ``topic``, ``partition``, ``offset`` and a ``ScoredRollout``
``value``, e.g. ``stream_rl.transport.Consumed``) and the trainer's current policy version.
Produces: batches of complete groups (:meth:`Batcher.take`), :class:`StaleDrop` events (one ``StaleRollout`` per
dropped rollout plus at most one re-queued ``Prompt``), the per-partition *safe offsets* and the ledger state
that a checkpoint stores.
Guarantees (pure: no Kafka, no clock, no I/O):

- Whole groups: a group is trained only when all ``group_size`` members arrived; groups leave in arrival order.
- Dedup: a record whose rollout id was trained, or is buffered now, is dropped and counted (at-least-once
  delivery upstream becomes at-most-once training here). Ids of a group dropped as stale leave the ledger, so
  the regenerated samples (same deterministic ids) are accepted.
- Staleness: lag = version - oldest token version (``stream_rl.algorithms.policy_lag``); lag > ``max_lag``
  makes the rollout stale, and one stale member makes its whole group stale: the buffered members are dropped,
  every dropped member gets a ``StaleRollout``, and the prompt is re-queued once with ``attempt + 1``. Later
  members of that dropped attempt are dropped as superseded (``requeued=False``), never re-queued again. A
  rollout claiming a version newer than the trainer's (weights lost in a crash) is stale with lag 0.
- Safe offsets: for each partition, every record below the safe offset is trained, dropped as a duplicate or
  dropped as stale (the loop flushes the stale records and re-queued prompts before committing or
  checkpointing). It is the smallest offset still held (buffered, ready or in training), else one past the
  last record seen::

      partition 0:  10 trained | 11 dup | 12 buffered (group g7) | 13 trained | 14 stale
                    safe offset = 12  -> a restart re-reads 12..14; 13 is then a duplicate, 14 stale again
                    (superseded, not re-queued twice: the ledger remembers the re-queued attempt)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from schemas import Prompt, ScoredRollout, StaleRollout
from stream_rl.algorithms import policy_lag

TopicPartition = tuple[str, int]


class RecordLike(Protocol):
    topic: str
    partition: int
    offset: int
    value: Any


@dataclass
class Group:
    """The members of one group id (one prompt and epoch), keyed by rollout id, in arrival order."""

    group_id: str
    group_size: int
    records: dict[str, RecordLike] = field(default_factory=dict)

    @property
    def rollouts(self) -> list[ScoredRollout]:
        return [r.value for r in self.records.values()]

    @property
    def complete(self) -> bool:
        return len(self.records) >= self.group_size


@dataclass(frozen=True)
class StaleDrop:
    """What to publish for one stale drop: a StaleRollout per dropped rollout and the prompt to re-queue."""

    stale: list[StaleRollout]
    requeue: Prompt | None


def rollout_lag(scored: ScoredRollout, current_version: int) -> int:
    """Policy lag of one rollout via ``stream_rl.algorithms.policy_lag``; negative if it is from a newer version."""
    versions = torch.from_numpy(scored.rollout.token_policy_versions.astype("int64"))[None, :]  # [1, R]
    newest = int(versions.max())
    if newest > current_version:
        return current_version - newest
    mask = torch.ones_like(versions, dtype=torch.bool)  # [1, R]
    return int(policy_lag(versions, mask, current_version)[0])


def requeued_prompt(scored: ScoredRollout, attempt: int) -> Prompt:
    """The prompt of ``scored`` again, with ``attempt`` (same prompt id and epoch, text/answer/metadata)."""
    r = scored.rollout
    return Prompt(prompt_id=r.prompt_id, epoch=r.epoch, text=r.prompt_text, answer=r.answer,
                  metadata=dict(r.metadata), group_size=r.group_size, attempt=attempt)


class Batcher:
    """Buffers scored rollouts into whole groups; see the module docstring for the guarantees."""

    def __init__(self, max_lag: int) -> None:
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {max_lag}")
        self.max_lag = max_lag
        self.trained: set[str] = set()
        self.requeued: dict[str, int] = {}  # group id -> highest attempt dropped as stale (and re-queued)
        self._buffering: dict[str, Group] = {}
        self._ready: deque[Group] = deque()
        self._in_flight: list[Group] = []
        self._held: dict[TopicPartition, set[int]] = {}  # offsets of held records, per partition
        self._held_ids: set[str] = set()  # rollout ids buffered, ready or in training
        self._last_seen: dict[TopicPartition, int] = {}
        self.counters = {"received": 0, "duplicates": 0, "stale": 0, "superseded": 0, "requeued": 0,
                         "trained": 0}

    # -- intake -------------------------------------------------------------------------------------------------

    def add(self, record: RecordLike, current_version: int) -> list[StaleDrop]:
        """Take one record; returns the stale drops it caused (empty for the common case)."""
        tp = (record.topic, record.partition)
        self._last_seen[tp] = max(self._last_seen.get(tp, -1), record.offset)
        self.counters["received"] += 1
        scored: ScoredRollout = record.value
        rid, gid, attempt = scored.rollout_id, scored.group_id, scored.rollout.attempt
        if rid in self.trained or rid in self._held_ids:
            self.counters["duplicates"] += 1
            return []
        if gid in self.requeued and attempt <= self.requeued[gid]:
            self.counters["superseded"] += 1
            reason = f"attempt {attempt} superseded: group re-queued after attempt {self.requeued[gid]} went stale"
            lag = max(rollout_lag(scored, current_version), 0)
            return [StaleDrop([self._stale_record(scored, lag, current_version, reason, False)], None)]
        lag = rollout_lag(scored, current_version)
        group = self._buffering.get(gid)
        if group is None:
            group = self._buffering[gid] = Group(gid, scored.rollout.group_size)
        group.records[rid] = record
        self._held.setdefault(tp, set()).add(record.offset)
        self._held_ids.add(rid)
        if lag > self.max_lag or lag < 0:
            return [self._drop_group(group, current_version, trigger=(rid, lag))]
        if group.complete:
            del self._buffering[gid]
            self._ready.append(group)
        return []

    def expire(self, current_version: int) -> list[StaleDrop]:
        """Drop every waiting group (buffering or ready) that became stale at ``current_version``."""
        drops = []
        for group in [*self._buffering.values(), *self._ready]:
            lags = {rid: rollout_lag(r.value, current_version) for rid, r in group.records.items()}
            worst = max(lags.items(), key=lambda item: item[1])
            if worst[1] > self.max_lag:
                drops.append(self._drop_group(group, current_version, trigger=worst))
        return drops

    # -- batches ------------------------------------------------------------------------------------------------

    @property
    def ready_groups(self) -> int:
        return len(self._ready)

    @property
    def buffered_groups(self) -> int:
        return len(self._buffering)

    def take(self, n_groups: int) -> list[Group] | None:
        """The ``n_groups`` oldest complete groups, now in training (still held), or None if fewer are ready."""
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        if len(self._ready) < n_groups:
            return None
        batch = [self._ready.popleft() for _ in range(n_groups)]
        self._in_flight.extend(batch)
        return batch

    def mark_trained(self, groups: Iterable[Group]) -> None:
        """Record ``groups`` (from :meth:`take`) as trained: ids join the ledger, their offsets are released."""
        for group in groups:
            self._in_flight.remove(group)
            for rid, record in group.records.items():
                self.trained.add(rid)
                self._release(record)
            self.counters["trained"] += len(group.records)

    # -- offsets and state --------------------------------------------------------------------------------------

    def safe_offsets(self) -> dict[TopicPartition, int]:
        """Per partition: the smallest offset still held, else one past the last record seen."""
        out = {}
        for tp, last in self._last_seen.items():
            held = self._held.get(tp)
            out[tp] = min(held) if held else last + 1
        return out

    def position(self, tp: TopicPartition) -> int | None:
        """One past the last offset seen on ``tp`` (where reading continues), None if nothing was seen."""
        last = self._last_seen.get(tp)
        return None if last is None else last + 1

    def ledger_state(self) -> dict[str, Any]:
        """JSON-ready state for a checkpoint: trained ids, re-queued attempts, counters (never the buffers)."""
        return {"trained": sorted(self.trained), "requeued": dict(sorted(self.requeued.items())),
                "counters": dict(self.counters)}

    @classmethod
    def from_state(cls, max_lag: int, state: Mapping[str, Any]) -> Batcher:
        """A batcher with the ledger of a checkpoint and empty buffers (the buffered records are re-read)."""
        batcher = cls(max_lag)
        batcher.trained = set(state.get("trained", ()))
        batcher.requeued = {str(k): int(v) for k, v in state.get("requeued", {}).items()}
        batcher.counters.update({k: int(v) for k, v in state.get("counters", {}).items()})
        return batcher

    # -- internals ----------------------------------------------------------------------------------------------

    def _release(self, record: RecordLike) -> None:
        self._held_ids.discard(record.value.rollout_id)
        held = self._held.get((record.topic, record.partition))
        if held is not None:
            held.discard(record.offset)

    def _drop_group(self, group: Group, version: int, trigger: tuple[str, int]) -> StaleDrop:
        if self._buffering.get(group.group_id) is group:
            del self._buffering[group.group_id]
        elif group in self._ready:
            self._ready.remove(group)
        trigger_id, trigger_lag = trigger
        if trigger_lag < 0:
            reason = f"{trigger_id} has policy version {version - trigger_lag} > trainer version {version}"
        else:
            reason = f"lag {trigger_lag} > max_lag {self.max_lag} ({trigger_id})"
        attempt = max(r.value.rollout.attempt for r in group.records.values())
        stale = []
        for record in group.records.values():
            self._release(record)
            lag = max(rollout_lag(record.value, version), 0)
            stale.append(self._stale_record(record.value, lag, version, reason, True))
        self.requeued[group.group_id] = max(attempt, self.requeued.get(group.group_id, -1))
        self.counters["stale"] += len(stale)
        self.counters["requeued"] += 1
        first = next(iter(group.records.values())).value
        return StaleDrop(stale, requeued_prompt(first, attempt + 1))

    def _stale_record(self, scored: ScoredRollout, lag: int, version: int, reason: str,
                      requeued: bool) -> StaleRollout:
        r = scored.rollout
        return StaleRollout(rollout_id=r.rollout_id, prompt_id=r.prompt_id, epoch=r.epoch, group_id=r.group_id,
                            reason=reason, lag=lag, max_lag=self.max_lag, trainer_version=version,
                            requeued=requeued)
