"""The producer's backpressure budget: may it take more prompts, or must it wait for newer weights? Pure: no Kafka.

Consumes: the groups this producer generated (``charge``), the groups already in flight when it started
(``inherit``, measured on the topics by :func:`producers.stale_feed.groups_in_flight`), the trainer's stale records
for the groups it dropped (``returned``, read from the run's stale topic by :class:`producers.stale_feed.StaleFeed`),
the weights version the producer holds and a monotonic clock (``over``).
Produces: ``over(version, now)``, and counters for :class:`producers.role.ProducerStats`.

The budget bounds the groups in flight, i.e. generated and not yet trained or dropped by the trainer::

    in_flight  = inherited + generated - returned           (since the budget began at version v0)
    allowed(v) = (v - skipped - v0 + 1 + versions_ahead) * share     share = producer.max_groups_per_version
    over       = in_flight >= allowed(v)

``inherited`` is what a restarted producer finds in flight at v0: the groups its previous process (or, with one
producer, any previous producer) generated that are still on the rollouts topic (not scored yet) or on the scored
topic past the trainer's committed offsets. A budget that began at zero (issue 45.1) let the restarted producer
put a full ``(1 + versions_ahead) * share`` on top of them; nothing ever took the surplus back (a group is returned
only when dropped, and dropping it re-queues it), so every restart of all roles raised the trained lag by about
``(1 + versions_ahead) * share / share`` versions for good: 1.5 -> 2.7 -> 2.8 (capped by drops at ``max_lag``) in
the demo setup, a quarter of all rollouts stale after two restarts in a longer run.

``skipped`` counts the versions that are no trained step (:meth:`Budget.held`, from each held version's trainer
step): a resumed trainer republishes its checkpoint's weights under a new number (``versions.reconcile``), e.g.
102 -> 107 after a crash past checkpoint 102 with 103..106 published. The resumed trainer re-reads the records it
had trained since the checkpoint, so its line is back at 102, not on at 107; counting 107 as 5 more versions of
allowance kept about 5 versions' worth of groups more in flight for the rest of the run, trained at lag up to
``max_lag`` + 5, i.e. a permanent tail of stale drops (issue 35.3). With ``k`` trainer steps per version (learned
from two consecutive versions, ``trainer.broadcast_every``), the versions trained between two held ones are
``(step' - step) // k``, negative across a resume (the line went back)::

    held:     v105 s105   v106 s106   v107 s102 (republished checkpoint)   v108 s103
    trained:       +1          +1          -4                                   +1
    skipped:        0           0           5                                    5
    allowed:  (105-v0+1+a)s  (106..)s   (102-v0+1+a)s                       (103-v0+1+a)s

Guarantees:
- A group the trainer dropped as stale is returned to the budget once per drop (the first stale record of the
  group counts, the group's other member records are absorbed), so its re-queued prompt and new prompts are
  generated: the budget counts what the trainer can still train, never what it discarded. Only groups this
  producer generated or inherited since the budget began, and only the newest ``TRACKED_SHARES`` shares of them,
  can be returned (state stays bounded).
- A group charged again at the attempt of a copy still in flight (a batch regenerated after a lost commit or a
  crash, an inherited group whose prompt was never committed), or at the attempt of a copy generated before the
  budget began and no longer in flight (``inherit``'s ``generated``: a predecessor that died after sending and
  before committing its prompts, whose groups the trainer has trained since), is not counted: the trainer trains
  one copy and drops the other as a duplicate, which returns nothing. Counting it stalled a restarted producer
  for ``stall_timeout_s`` (the drill ``producer.after_send``, tests/integration/test_failpoints_ledger.py).
- A producer that has waited over budget for ``stall_timeout_s`` while holding the same version re-derives the
  budget (``v0 := v``, counters zero, nothing inherited), logs it and counts it in ``resets``: a drop it could
  not see (lost stale records, another producer's id) or a group counted that will never be trained never stalls
  the pipeline for longer than that.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

TRACKED_SHARES = 8
"""How many versions' shares of recently generated groups are remembered for returns (at least 64 groups)."""


class InFlightGroup(Protocol):
    members: int  # rollouts of the group seen in flight
    attempt: int


@dataclass
class _Tracked:
    copies: int  # times generated and not returned yet
    size: int  # members of one copy (the stale records one drop produces)
    absorb: int = 0  # member records of an already returned drop still to come
    attempt: int = -1  # attempt of the copy generated last (-1: unknown)


@dataclass
class Budget:
    """See the module docstring. ``share=None`` disables backpressure (``over`` is always False)."""

    share: int | None
    versions_ahead: int
    start_version: int
    stall_timeout_s: float | None = None
    generated: int = 0
    returned: int = 0
    inherited: int = 0
    """Groups found in flight when the budget began (:meth:`inherit`); counted in ``generated`` too."""
    resets: int = 0
    skipped: int = 0
    """Versions held that were no trained step (a resume's republished checkpoint, see :meth:`held`)."""
    _groups: OrderedDict[str, _Tracked] = field(default_factory=OrderedDict, repr=False)
    _waiting: tuple[int, float] | None = field(default=None, repr=False)  # (version, since) while over budget
    _held: tuple[int, int] | None = field(default=None, repr=False)  # (version, trainer step) of the weights held
    _per_version: int | None = field(default=None, repr=False)  # trainer steps per version, from v -> v + 1
    _known: dict[str, int] = field(default_factory=dict, repr=False)  # group -> attempt generated before v0

    @property
    def in_flight(self) -> int:
        return self.generated - self.returned

    def allowed(self, version: int) -> int:
        """Groups that may be in flight while holding ``version`` (unbounded without a share)."""
        if self.share is None:
            return 1 << 62
        return max(0, version - self.skipped - self.start_version + 1 + self.versions_ahead) * self.share

    def held(self, version: int, step: int) -> None:
        """The producer now holds ``version``, whose weights the trainer took after its step ``step`` (the
        manifest's): the versions since the one held before that were no trained step are ``skipped`` (module
        docstring). Without a learned steps-per-version, a step that went back skips the new versions only."""
        if self._held is None or version <= self._held[0]:
            self._held = (version, step) if self._held is None else self._held
            return
        dv, ds = version - self._held[0], step - self._held[1]
        if dv == 1 and ds > 0:
            self._per_version = ds
        if self._per_version is not None:
            trained = min(dv, ds // self._per_version)
        else:
            trained = min(dv, max(ds, 0))
        if trained < dv:
            log.warning("backpressure: v%d (step %d) after v%d (step %d) is %d trained version(s), not %d (a "
                        "resumed trainer republished its checkpoint): the budget counts %d", version, step,
                        self._held[0], self._held[1], trained, dv, trained)
        self.skipped += dv - trained
        self._held = (version, step)

    def over(self, version: int, now: float) -> bool:
        """True while the producer must wait for newer weights; re-derives the budget after a stall."""
        if self.share is None or self.in_flight < self.allowed(version):
            self._waiting = None
            return False
        if self._waiting is None or self._waiting[0] != version:
            self._waiting = (version, now)
        elif self.stall_timeout_s is not None and now - self._waiting[1] >= self.stall_timeout_s:
            log.warning("backpressure: %d groups in flight (allowed %d at v%d) and no newer weights for %.0fs: "
                        "re-deriving the budget from v%d", self.in_flight, self.allowed(version), version,
                        now - self._waiting[1], version)
            self.rebase(version)
            return False
        return True

    def charge(self, group_sizes: Mapping[str, int], attempts: Mapping[str, int] | None = None) -> None:
        """Count newly generated groups (``group_id -> number of rollouts``; ``attempts``: ``group_id ->
        attempt``). A group still in flight at the same attempt is a regenerated copy and is not counted again."""
        for group_id, size in group_sizes.items():
            attempt = -1 if attempts is None else attempts.get(group_id, -1)
            if attempt >= 0 and self._known.pop(group_id, None) == attempt:
                continue  # generated before the budget began, at this attempt: the trainer drops this copy
            tracked = self._groups.pop(group_id, None) or _Tracked(0, size)
            if not (tracked.copies > 0 and attempt >= 0 and attempt == tracked.attempt):
                tracked.copies += 1
                self.generated += 1
            tracked.size, tracked.attempt = size, attempt
            self._groups[group_id] = tracked  # newest last
        self._bound()

    def inherit(self, groups: Mapping[str, InFlightGroup], version: int,
                generated: Mapping[str, int] | None = None) -> int:
        """Start the budget at ``version`` with ``groups`` in flight (generated before it began: :func:`producers.
        stale_feed.groups_in_flight`, measured with ``version`` the newest) counted as this producer's; their drops
        return them like its own. ``generated``: other groups generated before (``group_id -> attempt``): a copy
        charged at that attempt is a duplicate, never counted. Returns how many. Call it before generating."""
        self.start_version = version - self.skipped
        self._known = dict(generated or {})
        for group_id, found in groups.items():
            tracked = self._groups.pop(group_id, None) or _Tracked(0, max(found.members, 1))
            if not (tracked.copies > 0 and tracked.attempt == found.attempt):
                tracked.copies += 1
                self.generated += 1
                self.inherited += 1
            tracked.size, tracked.attempt = max(found.members, 1), found.attempt
            self._groups[group_id] = tracked
        self._bound()
        return len(groups)

    def _bound(self) -> None:
        limit = max(64, TRACKED_SHARES * (self.share or 0) * (self.versions_ahead + 1), self.inherited)
        while len(self._groups) > limit:
            self._groups.popitem(last=False)

    def returned_stale(self, group_ids: Iterable[str]) -> int:
        """Take the group ids of stale records (one per dropped rollout); return how many groups came back."""
        back = 0
        for group_id in group_ids:
            tracked = self._groups.get(group_id)
            if tracked is None:
                continue  # not ours, or from before the budget began
            if tracked.absorb > 0:
                tracked.absorb -= 1
            elif tracked.copies > 0:
                tracked.copies -= 1
                tracked.absorb = tracked.size - 1
                back += 1
        self.returned += back
        return back

    def rebase(self, version: int) -> None:
        """Start over at ``version`` with nothing in flight (the escape from a stall: module docstring)."""
        self.start_version = version - self.skipped
        self.generated = self.returned = self.inherited = 0
        self._known.clear()
        self._groups.clear()
        self._waiting = None
        self.resets += 1
