"""Issue 45.1: a clean restart of every role (SIGTERM trainer, scorer and producer, start them again, the trainer
with ``--resume``) must not raise the trained lag for good.

Before the fix the restarted producer's backpressure budget began at zero groups in flight at the version it
loaded at start-up, while the groups its predecessor generated were still on the rollouts and scored topics (and
the trainer, resuming first, trained some of them before the producer's first poll, which the new budget counted
as allowance of its own). It generated a full budget on top of them, nothing ever took the surplus back, and
every restart raised the steady lag by about two versions (1.5 -> 2.7 -> 2.8 here, stale drops at ``max_lag``).
Right after the restart the lag dips (the trainer drains its predecessor's groups, then trains the first fresh
ones), so the surplus shows from about the fifth version on: before the fix 1.9 -> 3.0 from there.

Counted in trained versions, not seconds: the run stops at a known step (the trainer checkpoints it on SIGTERM),
every role restarts, and the mean lag of the steps ``SETTLE+1 .. SETTLE+WINDOW`` after the restart is compared with
the steady lag of the same number of steps before it. The producer is far faster than the trainer (a tiny model,
5 tokens), so it always fills its budget: the lag is set by the budget's count of groups in flight, not by timing.
"""

from __future__ import annotations

import signal
import statistics

import pytest
from support.harness import Pipeline, demo_prompts, role_overrides, tiny_policy_dir

pytestmark = [pytest.mark.slow, pytest.mark.broker]

GROUP_SIZE, GROUPS_PER_STEP, MAX_LAG = 4, 4, 4
BEFORE, SETTLE, WINDOW = 10, 5, 10  # trained versions: steady state, after the restart: ignored, then measured
ROLES = ("train", "score", "produce")


def _steps(pipe: Pipeline) -> int:
    return max((r["step"] for r in pipe.metrics()), default=0)


def _mean_lag(rows: list[dict], first: int, last: int) -> float:
    return statistics.mean(r["staleness/mean_lag"] for r in rows if first <= r["step"] <= last)


@pytest.mark.timeout(420)
def test_a_clean_restart_of_every_role_keeps_the_steady_lag(make_config, tmp_path):
    model_dir = tiny_policy_dir(tmp_path / "policy")
    cfg = make_config(**role_overrides(model_dir, **{
        "trainer.groups_per_step": GROUPS_PER_STEP, "trainer.max_lag": MAX_LAG, "trainer.checkpoint_every": 5,
        "trainer.max_requeues": 100, "producer.versions_ahead": 1,
        "producer.max_groups_per_version": GROUPS_PER_STEP}))
    with Pipeline(cfg) as pipe:
        pipe.load(demo_prompts(tmp_path, 64, 4, GROUP_SIZE))  # 256 groups: more than the run trains
        kids = [pipe.start(role, 0) for role in ROLES]
        pipe.wait_until(lambda: _steps(pipe) >= BEFORE + 2, f"step {BEFORE + 2}", 240)
        for child in kids:  # the documented clean stop: each finishes its batch, the trainer checkpoints
            child.proc.send_signal(signal.SIGTERM)
        for child in kids:
            assert child.proc.wait(timeout=120) == 128 + signal.SIGTERM, child.role
            pipe.running.remove(child)
        restart = _steps(pipe)
        assert max(pipe.checkpoint_steps()) == restart
        kids = [pipe.start(role, 1, *(("--resume",) if role == "train" else ())) for role in ROLES]
        target = restart + SETTLE + WINDOW
        pipe.wait_until(lambda: _steps(pipe) >= target, f"step {target}", 240)
        rows = pipe.metrics()
        stale = [m for _, _, m in pipe.read("stale", "stale_rollout")]
        inherited = [line for line in kids[2].log.read_text().splitlines() if "already in flight" in line]

    steady = _mean_lag(rows, restart - BEFORE + 1, restart)
    after = _mean_lag(rows, restart + SETTLE + 1, target)
    window = [r for r in rows if restart < r["step"] <= target]
    trained_after = GROUP_SIZE * GROUPS_PER_STEP * len(window)
    stale_after = sum(1 for s in stale if s.trainer_version > restart)
    print(f"restart at step {restart}: mean lag {steady:.2f} before, {after:.2f} after; stale after the restart "
          f"{stale_after} of {trained_after + stale_after}; per step {[r['staleness/mean_lag'] for r in rows]}; "
          f"{inherited}")
    assert after <= steady + 0.5, f"the lag rose from {steady:.2f} to {after:.2f} after the restart"
    assert stale_after <= 0.03 * (trained_after + stale_after), (stale_after, trained_after)
