"""The producer's view of what happens downstream of it: the trainer's drops, and the groups already in flight.

Consumes: the run's stale topic (``StaleRollout`` records, one per dropped rollout, key ``group_id``), read
group-less by assignment, from the high-water marks taken from fetch responses when the feed starts (the broker's
ListOffsets(latest) cannot be trusted): only drops after the producer started matter to its budget.
For :func:`groups_in_flight`: the rollouts topic beyond the scorers' committed offsets and the scored topic beyond
the trainer's (the trainer commits its safe offsets after every step, ``consumers.trainer.trainer``), read once,
group-less, up to the high-water marks.
Produces: the group ids of the stale records that arrived since the last ``poll``; :func:`groups_in_flight`: the
groups generated before this producer started and not yet trained or dropped, and the other groups generated
lately (:class:`Downstream`), which the backpressure budget inherits (:meth:`producers.budget.Budget.inherit`)
through :func:`inheritance`, the producer's hold before its first batch.
Guarantees:
- Never blocks longer than the ``timeout_s`` given; never commits (no consumer group).
- Invalid records are skipped with a warning and counted (``invalid``): this reader does not own the topic.
- A stale topic missing at start-up is an error naming it and the command that creates it.
- :func:`groups_in_flight` errs towards counting (a group trained after the trainer's last commit is counted; one
  still in a scorer's hands or in the trainer's buffer is counted once), reads at most ``MAX_RECORDS`` records per
  partition (the newest), and counts a group only when ``mine(producer_id)`` says it belongs to this producer's
  budget (its own id; with one producer, every id: the previous process's groups are its to wait for).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from schemas import SchemaError, decode

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
MAX_RECORDS = 4096
"""Records read per partition by :func:`groups_in_flight` (the newest): more than any budget keeps in flight."""
DONE_RECORDS = 1024
"""Rollouts read per partition below the scorers' commits, for :attr:`Downstream.generated`: more than the
batches a producer can leave uncommitted."""


class StaleFeed:
    """Group ids of the trainer's stale records since the feed started."""

    def __init__(self, transport):
        self.topic = transport.names.stale
        self.invalid = 0
        self._reader = transport.reader()
        try:
            parts = self._reader.partitions(self.topic, timeout_s=START_TIMEOUT_S)
        except KeyError:
            self._reader.close()
            raise RuntimeError(f"stale topic {self.topic} does not exist (the producer's backpressure reads it); "
                               f"create the run's topics with `stream-rl topics create`") from None
        self._reader.follow(self._reader.highwaters(parts, timeout_s=START_TIMEOUT_S))

    def poll(self, timeout_s: float = 0.0) -> list[str]:
        """Group ids of the stale records that arrived since the last call (in partition order)."""
        out: list[str] = []
        for rec in self._reader.poll(timeout_s):
            try:
                out.append(decode(rec.value, "stale_rollout").group_id)
            except SchemaError as exc:
                self.invalid += 1
                log.warning("skipping invalid record %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, exc)
        return out

    def close(self) -> None:
        self._reader.close()


@dataclass
class InFlight:
    """One group found in flight: its members seen on the topics and its attempt."""

    members: int
    attempt: int


@dataclass
class Downstream:
    """What :func:`groups_in_flight` found: this producer's groups in flight, and every other group generated
    lately (the rollouts topic's newest ``DONE_RECORDS`` per partition, any producer) with its newest attempt:
    a copy of one of those generated again at that attempt (its prompt was never committed) is a duplicate the
    trainer drops without a stale record, never a group in flight."""

    in_flight: dict[str, InFlight]
    generated: dict[str, int]


def groups_in_flight(transport, mine: Callable[[str], bool]) -> Downstream:
    """Groups on the rollouts topic past the scorers' commits or on the scored topic past the trainer's whose
    producer id satisfies ``mine``, and the other groups generated lately (module docstring, :class:`Downstream`)."""
    names = transport.names
    with transport.admin() as admin:
        offsets = admin.group_offsets([names.group("scorers"), names.group("trainer")])
    found: dict[str, InFlight] = {}
    generated: dict[str, int] = {}
    with transport.reader() as reader:
        for topic, group, kind in ((names.rollouts, names.group("scorers"), "rollout"),
                                   (names.scored, names.group("trainer"), "scored_rollout")):
            committed = offsets.get(group, {})
            parts = reader.partitions(topic, timeout_s=START_TIMEOUT_S)
            for tp, high in reader.highwaters(parts, timeout_s=START_TIMEOUT_S).items():
                start = max(committed.get(tp, 0), high - MAX_RECORDS)
                if topic == names.rollouts:
                    start = min(start, max(high - DONE_RECORDS, 0))
                if start < high:
                    _count(reader.read_range(tp, start, high - start), kind, mine, found, committed.get(tp, 0),
                           generated)
    return Downstream(found, {g: a for g, a in generated.items() if g not in found})


def _count(records, kind: str, mine: Callable[[str], bool], found: dict[str, InFlight], committed: int = 0,
           generated: dict[str, int] | None = None) -> None:
    """Add the groups of ``records`` (rollouts, or scored rollouts: other kinds are skipped) at or past
    ``committed`` to ``found`` (``mine`` only), and every group's newest attempt to ``generated``."""
    seen: dict[str, set[str]] = {}
    for rec in records:
        try:
            raw = getattr(rec, "value", None)  # None: a batch the client could not read (SkippedRecord)
            value = decode(raw, kind) if raw is not None else None
        except SchemaError:
            continue  # a member-rejected notice, or a record its consumer dead-letters
        rollout = getattr(value, "rollout", value)
        if rollout is None:
            continue
        if generated is not None:
            generated[rollout.group_id] = max(rollout.attempt, generated.get(rollout.group_id, -1))
        if getattr(rec, "offset", committed) < committed or not mine(rollout.producer_id):
            continue
        ids = seen.setdefault(rollout.group_id, set())
        ids.add(rollout.rollout_id)
        held = found.get(rollout.group_id)
        if held is None or rollout.attempt > held.attempt:
            found[rollout.group_id] = InFlight(len(ids), rollout.attempt)
        elif rollout.attempt == held.attempt:
            held.members = max(held.members, len(ids))


def inheritance(transport, source, producer_id: str, follower, budget, stats) -> Callable[[], bool]:
    """The producer's hold after each poll (``producers.role``): once the prompts' partitions are assigned
    (the first poll), ``budget`` (a :class:`producers.budget.Budget`) starts over at the newest version
    (``follower``, a :class:`producers.weights_follower.WeightsFollower`, loads it) with the groups in flight then:
    this producer's own (``producer_id``), and every producer's when ``source`` reads every prompt partition (one
    producer). Returns True while the batch just polled must wait (over budget after all): a restart must not put
    a full budget on top of what its predecessor left in flight (issue 45.1)."""
    pending = [True]

    def hold() -> bool:
        assigned = source.assignment()
        if not pending or not assigned:
            return False
        pending.clear()
        alone = set(source.partitions(transport.names.prompts)) <= assigned
        version, found = _measure(transport, follower, lambda pid: alone or pid == producer_id)
        stats.groups_inherited = budget.inherit(found.in_flight, version, found.generated)
        log.info("backpressure: %d group(s) already in flight at v%d (%s), %d more generated lately; allowed %d",
                 len(found.in_flight), version, "any producer's: this one reads every prompt partition" if alone
                 else f"{producer_id}'s", len(found.generated), budget.allowed(version))
        return budget.over(version, time.monotonic())

    return hold


def _measure(transport, follower, mine: Callable[[str], bool], tries: int = 3) -> tuple[int, Downstream]:
    """The newest version and the groups in flight with it: the trainer commits after it publishes, so a version
    unchanged across the measurement means the commits read are not ahead of it (the count errs high, never low)."""
    for _ in range(tries):
        follower.update()
        version = follower.engine.version
        found = groups_in_flight(transport, mine)
        follower.update()
        if follower.engine.version == version:
            break
    return follower.engine.version, found
