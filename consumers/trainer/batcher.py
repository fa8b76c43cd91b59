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
- Staleness: lag = version - oldest token version (``stream_rl.algorithms.policy_lag``), measured along the
  trained line of weights after a resume that republished (:mod:`consumers.trainer.lineage`); lag > ``max_lag``
  makes the rollout stale, and one stale member makes its whole group stale: the buffered members are dropped,
  every dropped member gets a ``StaleRollout``, and the prompt is re-queued once with ``attempt + 1``. Later
  members of that dropped attempt are dropped as superseded (``requeued=False``), never re-queued again. A
  rollout claiming a version newer than the trainer's (weights lost in a crash) is stale with lag 0.
- Other group drops work the same way (stale records with the reason, one re-queue, later members superseded):
  a member rejected by the trainer's admission check (:meth:`Batcher.reject`; the loop dead-letters the member
  itself), or dead-lettered before it got here (:meth:`Batcher.reject_member`: a scorer's ``MemberRejected``
  notice, the trainer's own transport edge), drops its group at once instead of letting it pin the partition's
  safe offset (with no member buffered yet, the first one of that attempt to arrive drops it), and the groups of a
  step whose update was skipped (:meth:`Batcher.drop_skipped`) are dropped instead of being marked trained.
- Dynamic sampling (``uniform_atol`` set, DAPO): a group that completes with all rewards equal (max - min <=
  ``uniform_atol``) has GRPO advantages of exactly 0, so it is dropped to the stale topic with that reason
  (counter ``uniform``), never re-queued: its prompt was sampled, and the producers' budget gets the group back,
  so they sample other prompts in its place (the stale topic is the audit trail of what was not trained).
- Re-queue cap: a (prompt, epoch) is re-queued at most ``max_requeues`` times (attempts 1..max_requeues); a
  group of the last attempt that is dropped gets ``StaleRollout(requeued=False)`` with a reason saying so.
  :meth:`Batcher.note_requeued` merges re-queues a previous process already sent (the loop's re-queue log), so a
  restart does not re-queue the same (prompt, epoch, attempt) twice.
- Safe offsets: for each partition, every record below the safe offset is trained, dropped as a duplicate,
  dropped as stale or rejected (the loop flushes the stale records, re-queued prompts and dead letters before
  committing or checkpointing). It is the smallest offset still held (buffered, ready or in training), else one past the
  last record seen::

      partition 0:  10 trained | 11 dup | 12 buffered (group g7) | 13 trained | 14 stale
                    safe offset = 12  -> a restart re-reads 12..14; 13 is then a duplicate, 14 stale again
                    (superseded, not re-queued twice: the ledger remembers the re-queued attempt)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import numpy as np

from consumers.trainer.ledger import Ledger
from consumers.trainer.lineage import Lineage
from schemas import Prompt, ScoredRollout, StaleRollout

TopicPartition = tuple[str, int]
NO_JUMPS = Lineage()
MAX_DOOMED = 10_000
"""Groups remembered as rejected before any member arrived; beyond it the oldest is forgotten (and would only
wait to go stale)."""


class RecordLike(Protocol):
    topic: str
    partition: int
    offset: int
    value: Any  # the decoded message (a ScoredRollout here)


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
    """What to publish for one group drop: a StaleRollout per dropped rollout and the prompt to re-queue."""

    stale: list[StaleRollout]
    requeue: Prompt | None
    reason: str = ""


def rollout_lag(scored: ScoredRollout, current_version: int, lineage: Lineage = NO_JUMPS) -> int:
    """Policy lag of one rollout (``stream_rl.algorithms.policy_lag``'s formula); negative if it is from a newer
    version.
    After a resume that republished its checkpoint under a new number, the lag is measured along ``lineage``
    (the oldest token's steps from the current weights), so the resume itself makes nothing stale."""
    versions = scored.rollout.token_policy_versions  # [R] integers, validated at the edge
    newest = int(versions.max())
    if newest > current_version:
        return current_version - newest
    if lineage.jumps:
        return max(lineage.lag(int(v), current_version) for v in np.unique(versions).tolist())
    # policy_lag (stream_rl.algorithms.staleness) of one row whose tokens are all valid, without building tensors
    # for each record (tests/unit/test_trainer_batcher.py checks the two agree): current - min_t version_t
    return current_version - int(versions.min())


def requeued_prompt(scored: ScoredRollout, attempt: int) -> Prompt:
    """The prompt of ``scored`` again, with ``attempt`` (same prompt id and epoch, text/answer/metadata)."""
    r = scored.rollout
    return Prompt(prompt_id=r.prompt_id, epoch=r.epoch, text=r.prompt_text, answer=r.answer,
                  metadata=dict(r.metadata), group_size=r.group_size, attempt=attempt)


class Batcher:
    """Buffers scored rollouts into whole groups; see the module docstring for the guarantees."""

    def __init__(self, max_lag: int, max_requeues: int = 3, uniform_atol: float | None = None) -> None:
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {max_lag}")
        if max_requeues < 0:
            raise ValueError(f"max_requeues must be >= 0, got {max_requeues}")
        if uniform_atol is not None and uniform_atol < 0:
            raise ValueError(f"uniform_atol must be >= 0 or None, got {uniform_atol}")
        self.max_lag, self.max_requeues, self.uniform_atol = max_lag, max_requeues, uniform_atol
        self.lineage = NO_JUMPS  # set by the trainer from TrainState.lineage (resumes that republished)
        self.ledger = Ledger()  # trained (prompt, epoch) groups, compacted (consumers.trainer.ledger)
        self.requeued: dict[str, int] = {}  # group id -> highest attempt dropped as stale (and re-queued)
        self._buffering: dict[str, Group] = {}
        self._ready: deque[Group] = deque()
        self._in_flight: list[Group] = []
        self._held: dict[TopicPartition, set[int]] = {}  # offsets of held records, per partition
        self._held_ids: set[str] = set()  # rollout ids buffered, ready or in training
        self._last_seen: dict[TopicPartition, int] = {}
        self._doomed: dict[str, tuple[int | None, str]] = {}  # group id -> (attempt, reason): no member yet
        self.counters = {"received": 0, "duplicates": 0, "stale": 0, "superseded": 0, "requeued": 0,
                         "trained": 0, "rejected": 0, "skipped": 0, "not_requeued": 0, "uniform": 0}

    # -- intake -------------------------------------------------------------------------------------------------

    def add(self, record: RecordLike, current_version: int) -> list[StaleDrop]:
        """Take one record; returns the stale drops it caused (empty for the common case)."""
        self._see(record)
        scored: ScoredRollout = record.value
        rid, gid, attempt = scored.rollout_id, scored.group_id, scored.rollout.attempt
        if self._trained(scored) or rid in self._held_ids:
            self.counters["duplicates"] += 1
            return []
        if gid in self.requeued and attempt <= self.requeued[gid]:
            self.counters["superseded"] += 1
            reason = f"attempt {attempt} superseded: group re-queued after attempt {self.requeued[gid]} was dropped"
            lag = max(rollout_lag(scored, current_version, self.lineage), 0)
            return [StaleDrop([self._stale_record(scored, lag, current_version, reason, False)], None)]
        lag = rollout_lag(scored, current_version, self.lineage)
        group = self._buffering.get(gid)
        if group is None:
            group = self._buffering[gid] = Group(gid, scored.rollout.group_size)
        group.records[rid] = record
        self._held.setdefault((record.topic, record.partition), set()).add(record.offset)
        self._held_ids.add(rid)
        doomed = self._doomed_reason(gid, attempt)
        if doomed is not None:
            return [self._drop_group(group, current_version, doomed)]
        if lag > self.max_lag or lag < 0:
            return [self._drop_group(group, current_version, self._lag_reason(current_version, rid, lag))]
        if group.complete:
            uniform = self._uniform_reason(group)
            if uniform is not None:
                return [self._drop_group(group, current_version, uniform, counter="uniform", requeue=False)]
            del self._buffering[gid]
            self._ready.append(group)
        return []

    def _uniform_reason(self, group: Group) -> str | None:
        """Dynamic sampling's drop reason for a complete group whose rewards are all equal, else None."""
        if self.uniform_atol is None:
            return None
        rewards = [s.reward for s in group.rollouts]
        if max(rewards) - min(rewards) > self.uniform_atol:
            return None
        return (f"dynamic sampling: all {len(rewards)} rewards of the group equal {rewards[0]:g} "
                f"(no GRPO gradient; trainer.dynamic_sampling)")

    def reject(self, record: RecordLike, current_version: int, reason: str) -> list[StaleDrop]:
        """Take one record that failed admission (the caller dead-letters it): its group can never complete, so
        the buffered members are dropped at once with ``reason`` and the prompt re-queued. A copy of a rollout
        already held or trained, a member of an attempt already dropped, or a stray member of a group that is
        already whole changes nothing."""
        self._see(record)
        self.counters["rejected"] += 1
        scored: ScoredRollout = record.value
        rid, gid, attempt = scored.rollout_id, scored.group_id, scored.rollout.attempt
        if self._trained(scored) or rid in self._held_ids:
            return []
        if gid in self.requeued and attempt <= self.requeued[gid]:
            return []
        if any(g.group_id == gid for g in (*self._ready, *self._in_flight)):
            return []
        group = self._buffering.get(gid) or Group(gid, scored.rollout.group_size)
        return [self._drop_group(group, current_version, f"member {rid} was dead-lettered: {reason}",
                                 source=scored)]

    def reject_member(self, group_id: str, attempt: int | None, reason: str, current_version: int,
                      at: RecordLike | None = None) -> list[StaleDrop]:
        """A member of ``group_id`` (of ``attempt``; None: unknown) was dead-lettered before it reached this
        batcher (a scorer's ``MemberRejected``, or the trainer's own transport edge; ``at``: the record that said
        so, whose offset counts as seen). The group can never complete: its buffered members are dropped at once
        with ``reason`` and the prompt re-queued, or, with none buffered yet, the first member of that attempt
        to arrive drops it. A group already trained, whole, or dropped at that attempt (attempt unknown: at any
        attempt) is left alone, so a repeated rejection changes nothing."""
        if at is not None:
            self._see(at)
        self.counters["rejected"] += 1
        prompt_id, epoch = group_id.rsplit(":", 1)
        if self.ledger.trained(prompt_id, int(epoch)):
            return []
        if group_id in self.requeued and (attempt is None or attempt <= self.requeued[group_id]):
            return []
        if any(g.group_id == group_id for g in (*self._ready, *self._in_flight)):
            return []
        group = self._buffering.get(group_id)
        if group is None:
            self._doomed[group_id] = (attempt, reason)
            while len(self._doomed) > MAX_DOOMED:  # oldest first: a group that never arrives is forgotten
                del self._doomed[next(iter(self._doomed))]
            return []
        buffered = max(r.value.rollout.attempt for r in group.records.values())
        if attempt is not None and attempt < buffered:
            return []  # a rejection of an older attempt than the one buffered
        return [self._drop_group(group, current_version, f"a member was dead-lettered: {reason}")]

    def _doomed_reason(self, group_id: str, attempt: int) -> str | None:
        """The drop reason when a member of ``group_id`` of ``attempt`` was rejected before any arrived."""
        doomed = self._doomed.get(group_id)
        if doomed is None or (doomed[0] is not None and doomed[0] > attempt):
            return None
        del self._doomed[group_id]
        if doomed[0] is not None and doomed[0] < attempt:
            return None  # it rejected an older attempt: this one can still complete
        return f"a member was dead-lettered: {doomed[1]}"

    def note_requeued(self, group_id: str, attempt: int) -> None:
        """Remember that attempt ``attempt`` of ``group_id`` was dropped and its prompt re-queued (by a previous
        process): its members are superseded from now on, never re-queued again. A group already trained needs no
        entry (its members are duplicates), so none is kept."""
        prompt_id, epoch = group_id.rsplit(":", 1)
        if not self.ledger.trained(prompt_id, int(epoch)):
            self.requeued[group_id] = max(attempt, self.requeued.get(group_id, -1))

    def expire(self, current_version: int) -> list[StaleDrop]:
        """Drop every waiting group (buffering or ready) that became stale at ``current_version``."""
        drops = []
        for group in [*self._buffering.values(), *self._ready]:
            lags = {rid: rollout_lag(r.value, current_version, self.lineage) for rid, r in group.records.items()}
            worst = max(lags.items(), key=lambda item: item[1])
            if worst[1] > self.max_lag:
                drops.append(self._drop_group(group, current_version, self._lag_reason(current_version, *worst)))
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
            first = next(iter(group.records.values())).value.rollout
            self.ledger.add(first.prompt_id, first.epoch)
            self.requeued.pop(group.group_id, None)  # its members are duplicates now, whatever their attempt
            self._doomed.pop(group.group_id, None)
            for record in group.records.values():
                self._release(record)
            self.counters["trained"] += len(group.records)

    def drop_skipped(self, groups: Iterable[Group], current_version: int, reason: str) -> list[StaleDrop]:
        """Release ``groups`` (from :meth:`take`) whose update was skipped: they are not trained, their ids stay
        out of the ledger, and each is dropped to the stale topic with ``reason`` and its prompt re-queued."""
        drops = []
        for group in groups:
            self._in_flight.remove(group)
            drops.append(self._drop_group(group, current_version, reason, counter="skipped"))
        return drops

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
        """JSON-ready state for a checkpoint: the compacted ledger of trained groups, the re-queued attempts of
        groups not trained yet, counters (never the buffers)."""
        return {"groups": self.ledger.to_json(), "requeued": dict(sorted(self.requeued.items())),
                "counters": dict(self.counters)}

    @classmethod
    def from_state(cls, max_lag: int, state: Mapping[str, Any], max_requeues: int = 3,
                   uniform_atol: float | None = None) -> Batcher:
        """A batcher with the ledger of a checkpoint and empty buffers (the buffered records are re-read)."""
        batcher = cls(max_lag, max_requeues, uniform_atol)
        batcher.ledger = Ledger.from_json(state.get("groups"), state.get("trained", ()))  # "trained": older form
        batcher.requeued = {str(k): int(v) for k, v in state.get("requeued", {}).items()}
        batcher.counters.update({k: int(v) for k, v in state.get("counters", {}).items()})
        return batcher

    # -- internals ----------------------------------------------------------------------------------------------

    def _release(self, record: RecordLike) -> None:
        self._held_ids.discard(record.value.rollout_id)
        held = self._held.get((record.topic, record.partition))
        if held is not None:
            held.discard(record.offset)

    def _trained(self, scored: ScoredRollout) -> bool:
        return self.ledger.trained(scored.rollout.prompt_id, scored.rollout.epoch)

    def see(self, record: RecordLike) -> None:
        """Count ``record``'s offset as seen without taking it (the loop dead-lettered it, and it names no
        group): safe offsets move past it."""
        self._see(record)

    def _see(self, record: RecordLike) -> None:
        tp = (record.topic, record.partition)
        self._last_seen[tp] = max(self._last_seen.get(tp, -1), record.offset)
        self.counters["received"] += 1

    def _lag_reason(self, version: int, trigger_id: str, trigger_lag: int) -> str:
        if trigger_lag < 0:
            return f"{trigger_id} has policy version {version - trigger_lag} > trainer version {version}"
        return f"lag {trigger_lag} > max_lag {self.max_lag} ({trigger_id})"

    def _drop_group(self, group: Group, version: int, reason: str, counter: str = "stale",
                    source: ScoredRollout | None = None, requeue: bool = True) -> StaleDrop:
        """Drop ``group`` (wherever it waits) with ``reason``: StaleRollouts for its members, one re-queue unless
        its attempt is the last (``max_requeues``) or ``requeue`` is False. ``source``: a rollout of the group when
        none is buffered."""
        if self._buffering.get(group.group_id) is group:
            del self._buffering[group.group_id]
        elif group in self._ready:
            self._ready.remove(group)
        members = [r.value for r in group.records.values()]
        first = members[0] if members else source
        attempt = max(s.rollout.attempt for s in [*members, *([source] if source is not None else [])])
        self.requeued[group.group_id] = max(attempt, self.requeued.get(group.group_id, -1))
        retry = requeue and attempt < self.max_requeues  # a group has a member or a source: first is one
        prompt = requeued_prompt(cast(ScoredRollout, first), attempt + 1) if retry else None
        if prompt is None and requeue:
            reason = f"{reason}; not re-queued: attempt {attempt} is the last (max_requeues {self.max_requeues})"
            self.counters["not_requeued"] += 1
        elif prompt is not None:
            self.counters["requeued"] += 1
        stale = []
        for record in group.records.values():
            self._release(record)
            lag = max(rollout_lag(record.value, version, self.lineage), 0)
            stale.append(self._stale_record(record.value, lag, version, reason, prompt is not None))
        self.counters[counter] += len(stale)
        return StaleDrop(stale, prompt, reason)

    def _stale_record(self, scored: ScoredRollout, lag: int, version: int, reason: str,
                      requeued: bool) -> StaleRollout:
        r = scored.rollout
        return StaleRollout(rollout_id=r.rollout_id, prompt_id=r.prompt_id, epoch=r.epoch, group_id=r.group_id,
                            reason=reason, lag=lag, max_lag=self.max_lag, trainer_version=version,
                            requeued=requeued)
