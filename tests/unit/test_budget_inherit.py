"""Issue 45.1: a restarted producer's backpressure budget inherits the groups already in flight
(:meth:`producers.budget.Budget.inherit`) instead of starting at zero on top of them, and a regenerated copy of a
group still in flight is not counted twice. Hand-computed values: ``allowed(v) = (v - skipped - v0 + 1 +
versions_ahead) * share``, ``in_flight = inherited + generated - returned``."""

from __future__ import annotations

from types import SimpleNamespace

from producers.budget import Budget
from producers.stale_feed import InFlight, _count


def _groups(n: int, attempt: int = 0, members: int = 4) -> dict[str, InFlight]:
    return {f"p{i}:0": InFlight(members, attempt) for i in range(n)}


def test_a_restart_starts_at_the_measured_version_with_the_groups_in_flight():
    """Budget made at v12 (start-up); the trainer drained 2 versions before the first poll, then 6 groups were
    found in flight at v14: allowed(14) = (14 - 14 + 1 + 1) * 4 = 8, 6 in flight, so 2 more may go (not 16)."""
    budget = Budget(share=4, versions_ahead=1, start_version=12)
    assert budget.inherit(_groups(6), version=14) == 6
    assert (budget.start_version, budget.inherited, budget.in_flight, budget.allowed(14)) == (14, 6, 6, 8)
    assert not budget.over(14, now=0.0)
    budget.charge({f"new{i}:0": 4 for i in range(2)})
    assert budget.over(14, now=0.0)
    assert not budget.over(15, now=0.0)  # one trained version later: 12 allowed, 8 in flight


def test_an_inherited_group_dropped_as_stale_is_returned_once():
    budget = Budget(share=4, versions_ahead=1, start_version=0)
    budget.inherit(_groups(3), version=5)
    assert budget.returned_stale(["p1:0"] * 4 + ["p1:0"] * 4 + ["other:0"]) == 1  # the 2nd drop: not ours twice
    assert budget.in_flight == 2


def test_a_regenerated_copy_at_the_same_attempt_is_not_counted_twice():
    """A prompt whose batch was sent but not committed is generated again (same ids): the trainer trains one copy
    and drops the other as a duplicate, which returns nothing. A re-queued attempt is a new copy."""
    budget = Budget(share=4, versions_ahead=1, start_version=0)
    budget.inherit({"p0:0": InFlight(4, 0)}, version=0)
    budget.charge({"p0:0": 4}, {"p0:0": 0})
    assert budget.in_flight == 1
    budget.charge({"p0:0": 4}, {"p0:0": 1})  # attempt 1 (re-queued before the stale records were read)
    assert budget.in_flight == 2
    budget.charge({"p1:0": 4}, {"p1:0": 0})
    budget.charge({"p1:0": 4}, {"p1:0": 0})  # a lost commit regenerated it
    assert budget.in_flight == 3


def test_a_stall_rebase_forgets_what_was_inherited():
    budget = Budget(share=2, versions_ahead=0, start_version=0, stall_timeout_s=10.0)
    budget.inherit(_groups(5), version=3)
    assert budget.over(3, now=0.0) and budget.over(3, now=5.0)
    assert not budget.over(3, now=10.0)
    assert (budget.inherited, budget.in_flight, budget.resets, budget.start_version) == (0, 0, 1, 3)


def _rec(group: str, sample: int, producer: str, attempt: int = 0):
    rollout = SimpleNamespace(group_id=group, rollout_id=f"{group}:{sample}", producer_id=producer, attempt=attempt)
    return SimpleNamespace(value=rollout)


def test_groups_are_counted_once_with_their_members_and_newest_attempt(monkeypatch):
    import producers.stale_feed as feed

    monkeypatch.setattr(feed, "decode", lambda raw, kind: raw)  # the records hold decoded values already
    found: dict[str, InFlight] = {}
    records = [_rec("a:0", 0, "producer-0"), _rec("a:0", 1, "producer-0"), _rec("b:0", 0, "producer-9"),
               _rec("a:0", 0, "producer-0", attempt=1), SimpleNamespace(value=None)]
    _count(records, "rollout", lambda pid: pid == "producer-0", found)
    assert found == {"a:0": InFlight(2, 1)}


def test_a_group_generated_before_the_restart_and_trained_since_is_a_duplicate_not_in_flight():
    """The predecessor died after sending p0 and p1 and before committing their prompts; the trainer trained them.
    Generating them again at attempt 0 puts nothing in flight (the trainer drops the copies as duplicates, with
    no stale record to return them): counted, they filled allowed(2) = 4 of share 2 and stalled the producer."""
    budget = Budget(share=2, versions_ahead=1, start_version=0)
    budget.inherit({}, version=2, generated={"p0:0": 0, "p1:0": 0, "p2:0": 1})
    budget.charge({"p0:0": 2, "p1:0": 2, "p2:0": 2, "p3:0": 2}, {"p0:0": 0, "p1:0": 0, "p2:0": 2, "p3:0": 0})
    assert budget.in_flight == 2 and not budget.over(2, now=0.0)  # p2 (a newer attempt) and p3 count
    budget.charge({"p0:0": 2}, {"p0:0": 0})  # known once only: a second copy now is this producer's own
    assert budget.in_flight == 3
