"""Issue 35.3, the cause: the producers' backpressure budget counted a resume's republished checkpoint (102 -> 107)
as five trained versions, so about five versions' worth of groups more stayed in flight for the rest of the run and
were trained at lag up to max_lag + 5 (a permanent tail of stale drops). :meth:`producers.budget.Budget.held` counts
the versions trained between two held ones from the manifests' trainer steps. Hand-computed values throughout:
``allowed(v) = (v - skipped - v0 + 1 + versions_ahead) * share``."""

from __future__ import annotations

from producers.budget import Budget


def _follow(budget: Budget, pairs) -> None:
    for version, step in pairs:
        budget.held(version, step)


def test_consecutive_versions_are_each_one_trained_version():
    budget = Budget(share=2, versions_ahead=1, start_version=0)
    _follow(budget, [(v, v) for v in range(7)])
    assert budget.skipped == 0 and budget.allowed(6) == (6 + 1 + 1) * 2 == 16


def test_a_republished_checkpoint_puts_the_budget_back_where_the_checkpoint_was():
    """v0..v6 trained at steps 0..6; the trainer crashes after checkpoint step 3 and republishes it as v7 (step 3):
    the budget is the one of v3, (3 + 1 + 1) * 2 = 10, not (7 + 1 + 1) * 2 = 18 as before; v8 (step 4) is v4's."""
    budget = Budget(share=2, versions_ahead=1, start_version=0)
    _follow(budget, [(v, v) for v in range(7)] + [(7, 3)])
    assert budget.skipped == 4 and budget.allowed(7) == 10
    budget.held(8, 4)
    assert budget.skipped == 4 and budget.allowed(8) == 12


def test_steps_per_version_are_learned_from_consecutive_versions():
    """trainer.broadcast_every = 2: v0..v3 at steps 0, 2, 4, 6; checkpoint step 2 republished as v4: the trained
    line is at v1 (step 2), so allowed(4) = (1 + 1 + 1) * 3 = 9; a producer that skipped versions (v5 step 4 ->
    v7 step 8) counts both."""
    budget = Budget(share=3, versions_ahead=1, start_version=0)
    _follow(budget, [(0, 0), (1, 2), (2, 4), (3, 6), (4, 2)])
    assert budget.skipped == 3 and budget.allowed(4) == 9
    _follow(budget, [(5, 4), (7, 8)])
    assert budget.skipped == 3 and budget.allowed(7) == (7 - 3 + 1 + 1) * 3 == 18


def test_without_a_learned_rate_a_step_that_goes_back_only_stops_the_growth():
    """Only v5 (step 5) seen before the republished v9 (step 2): no steps-per-version known, so the jump adds no
    allowance (the four new versions are skipped) but takes none away."""
    budget = Budget(share=1, versions_ahead=0, start_version=5)
    _follow(budget, [(5, 5), (9, 2)])
    assert budget.skipped == 4 and budget.allowed(9) == 1  # as at v5: (5 - 5 + 1 + 0) * 1


def test_the_budget_waits_after_a_republish_until_the_trainer_trains_on():
    """In flight at v6: 16 groups (the allowance); the republish v7 (step 3) leaves it over budget (10), and only
    returns (stale drops) or trained versions (v8..v11 at steps 4..7) bring it back under."""
    budget = Budget(share=2, versions_ahead=1, start_version=0)
    _follow(budget, [(v, v) for v in range(7)])
    budget.charge({f"g{i}": 2 for i in range(16)})
    assert budget.over(6, now=0.0)
    budget.held(7, 3)
    assert budget.over(7, now=1.0) and budget.allowed(7) == 10
    _follow(budget, [(8, 4), (9, 5)])
    assert budget.over(9, now=2.0)  # allowed 14 < 16
    budget.held(10, 6)
    assert budget.allowed(10) == 16  # as at v6: the trained line is back where it was
    budget.held(11, 7)
    assert not budget.over(11, now=3.0)  # allowed 18 > 16 in flight


def test_a_rebase_after_a_stall_keeps_counting_from_the_trained_line():
    budget = Budget(share=2, versions_ahead=0, start_version=0, stall_timeout_s=5.0)
    _follow(budget, [(0, 0), (1, 1), (2, 2), (5, 1)])  # republished checkpoint step 1 as v5
    assert budget.skipped == 4
    budget.charge({"a": 1, "b": 1, "c": 1, "d": 1})
    assert budget.over(5, now=0.0) and budget.over(5, now=5.0) is False and budget.resets == 1
    assert budget.allowed(5) == 2 and budget.allowed(6) == 4
