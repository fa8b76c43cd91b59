"""Each alert rule on crafted sample sequences: fires past its bound, not on the bound, not on missing data, and
resolves when the condition clears; the formulas against hand-computed values."""

from __future__ import annotations

import math

import pytest

from stream_rl.alerts.config import AlertsConfig
from stream_rl.alerts.engine import AlertEngine
from stream_rl.alerts.rules import (
    above_since,
    dlq_rate_per_minute,
    increase_fraction,
    least_squares_slope,
    no_increase_since,
    window_means,
)


def engine(role: str = "trainer", **sections) -> AlertEngine:
    return AlertEngine(AlertsConfig(**sections), role, f"{role}-0001")


def states(transitions) -> list[tuple[str, str]]:
    return [(a.name, a.state) for a in transitions]


# ------------------------------------------------------------------------------------------------ formulas


def test_least_squares_slope_matches_hand_computation():
    # t_mean 1.5, v_mean 3; sum((t-tm)(v-vm)) = 4.5 + 0.5 + 0 + 6 = 11; sum((t-tm)^2) = 5 -> 2.2
    assert least_squares_slope([(0, 0), (1, 2), (2, 3), (3, 7)]) == pytest.approx(2.2)
    assert least_squares_slope([(t, 5.0 + 3.0 * t) for t in range(10)]) == pytest.approx(3.0)
    assert least_squares_slope([(1.0, 4.0), (1.0, 9.0)]) == 0.0  # no spread in time
    assert least_squares_slope([(0.0, 1.0)]) == 0.0


def test_increase_fraction_and_window_means():
    assert increase_fraction([1, 2, 2, 3, 1]) == 0.5  # +, 0, +, -
    assert increase_fraction([1]) == 0.0
    assert window_means([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]
    assert window_means([1, 2], 3) == []


def test_run_starts_and_dlq_rate_formula():
    assert above_since([(0, 150), (5, 50), (10, 150), (12, 200)], 100) == 10
    assert above_since([(0, 150), (5, 100)], 100) is None  # latest on the bound
    assert no_increase_since([(0, 0), (30, 1), (60, 1), (89, 1)]) == 30
    assert no_increase_since([(0, 3), (10, 5)]) == 10
    assert no_increase_since([]) is None
    # 10 dead letters over the 60 s window = 10 per minute; a reset never counts negative
    assert dlq_rate_per_minute([(0, 0), (30, 5), (60, 10)], 60, 60) == 10.0
    assert dlq_rate_per_minute([(0, 0), (30, 5), (60, 10), (61, 12)], 61, 60) == 12.0
    assert dlq_rate_per_minute([(0, 40), (30, 2)], 30, 60) == 0.0


# ------------------------------------------------------------------------------------------------ rules


@pytest.mark.parametrize("key,name", [("loss/total", "loss_nonfinite"), ("optim/grad_norm", "grad_norm_nonfinite")])
def test_nonfinite_rules_fire_on_nan_and_inf_and_resolve(key, name):
    e = engine()
    assert e.observe(0, {key: 1e30}) == []  # huge but finite
    assert e.observe(1, {"step": 1}) == []  # missing key: no data
    fired = e.observe(2, {key: math.nan})
    assert states(fired) == [(name, "firing")]
    assert fired[0].action == "stop" and fired[0].value is None
    assert e.observe(3, {key: math.inf}) == []  # still firing: no new transition
    assert states(e.observe(4, {key: 0.5})) == [(name, "resolved")]
    assert states(e.observe(5, {key: -math.inf})) == [(name, "firing")]


def test_kl_ref_high_bound_is_strict_and_consecutive_counts():
    e = engine(kl_ref_high={"max_kl": 0.5})
    assert e.observe(0, {"kl/ref_mean": 0.5}) == []  # on the bound
    fired = e.observe(1, {"kl/ref_mean": 0.75})
    assert states(fired) == [("kl_ref_high", "firing")]
    assert fired[0].value == 0.75 and fired[0].threshold == 0.5 and fired[0].action == "log"
    assert states(e.observe(2, {"kl/ref_mean": 0.25})) == [("kl_ref_high", "resolved")]

    e = engine(kl_ref_high={"max_kl": 0.5, "consecutive": 3})
    assert e.observe(0, {"kl/ref_mean": 0.75}) == []
    assert e.observe(1, {"kl/ref_mean": 0.75}) == []
    assert states(e.observe(2, {"kl/ref_mean": 0.75})) == [("kl_ref_high", "firing")]
    assert states(e.observe(3, {"kl/ref_mean": 0.5})) == [("kl_ref_high", "resolved")]  # one at the bound breaks it


def test_logprob_mismatch_bound_is_strict():
    e = engine(logprob_mismatch={"max_abs_diff": 0.25})
    assert e.observe(0, {"mismatch/logp_abs_diff": 0.25}) == []
    assert e.observe(1, {}) == []
    assert states(e.observe(2, {"mismatch/logp_abs_diff": 0.375})) == [("logprob_mismatch", "firing")]
    assert states(e.observe(3, {"mismatch/logp_abs_diff": 0.125})) == [("logprob_mismatch", "resolved")]


def test_reward_drop_compares_the_last_window_with_the_best_earlier_one():
    e = engine(reward_drop={"window_steps": 2, "max_drop": 0.25})
    # fewer than 2W samples: no verdict
    for t, r in enumerate([1.0, 1.0, 0.75]):
        assert e.observe(t, {"reward/mean": r}) == []
    # windows [1,1]=1.0 ... current [0.75,0.75]=0.75: drop 0.25 exactly = bound -> no alert
    assert e.observe(3, {"reward/mean": 0.75}) == []
    # current [0.75,0.5]=0.625, best earlier window 1.0: drop 0.375 > 0.25
    fired = e.observe(4, {"reward/mean": 0.5})
    assert states(fired) == [("reward_drop", "firing")]
    assert fired[0].value == pytest.approx(0.375) and fired[0].threshold == 0.25
    assert e.observe(5, {"step": 5}) == []  # no reward sample: no verdict change
    # current [0.5, 1.0] = 0.75, best earlier window 1.0: drop 0.25 is on the bound -> resolved
    resolved = e.observe(6, {"reward/mean": 1.0})
    assert states(resolved) == [("reward_drop", "resolved")] and resolved[0].value == pytest.approx(0.25)
    assert e.firing == []


def test_consumer_lag_must_stay_above_n_for_t_seconds():
    e = engine("scorer", consumer_lag={"max_records": 100, "for_s": 10})
    assert e.observe(0, {"lag/position_total": 150}) == []
    assert e.observe(9.9, {"lag/position_total": 150}) == []
    fired = e.observe(10, {"lag/position_total": 200})
    assert states(fired) == [("consumer_lag", "firing")]
    assert fired[0].value == 200 and fired[0].threshold == 100 and fired[0].role == "scorer"
    assert states(e.observe(11, {"lag/position_total": 100})) == [("consumer_lag", "resolved")]  # back on the bound
    # a dip restarts the clock
    assert e.observe(12, {"lag/position_total": 150}) == []
    assert e.observe(21.9, {"lag/position_total": 150}) == []
    assert states(e.observe(22, {"lag/position_total": 150})) == [("consumer_lag", "firing")]

    # exactly N for a long time never fires; no lag data never fires
    e = engine("scorer", consumer_lag={"max_records": 100, "for_s": 10})
    assert all(e.observe(t, {"lag/position_total": 100}) == [] for t in range(0, 100, 5))
    assert all(e.observe(t, {}) == [] for t in range(100, 200, 5))


def test_consumer_lag_window_stays_bounded_while_firing():
    e = engine("scorer", consumer_lag={"max_records": 0, "for_s": 10})
    fired = [a for t in range(1000) for a in e.observe(float(t), {"lag/position_total": 5})]
    assert states(fired) == [("consumer_lag", "firing")]
    assert len(e._windows["lag/position_total"].samples) <= 12  # 10 s of 1 s samples + the anchor


def test_consumer_lag_ignores_the_committed_lag():
    """The trainer commits at checkpoints only: a committed lag of thousands is no alert; its position is."""
    e = engine("trainer", consumer_lag={"max_records": 100, "for_s": 10})
    assert all(e.observe(t, {"lag/total": 5000, "lag/position_total": 3}) == [] for t in range(0, 100, 5))
    assert states(e.observe(100, {"lag/position_total": 500})) == []
    assert states(e.observe(110, {"lag/position_total": 500})) == [("consumer_lag", "firing")]


def test_a_producers_prompt_lag_is_judged_by_its_growth():
    """Prompts loaded ahead: 10,000 behind and falling (or flat, producers held back by the trainer) is healthy;
    lag that keeps rising (a = the sample at now - T; W = a .. latest) fires."""
    e = engine("producer", consumer_lag={"max_records": 100, "for_s": 10})
    assert all(e.observe(t, {"lag/position_total": 10_000 - 50 * t}) == [] for t in range(0, 60, 2))  # falling
    assert all(e.observe(t, {"lag/position_total": 7_000}) == [] for t in range(60, 120, 2))  # flat
    # one jump (a requeue or a reload) then flat: at t = 130, a = 120 (7000), W rises in 1 of 5 steps: 20 % < 50 %
    assert e.observe(122, {"lag/position_total": 9_000}) == []
    assert all(e.observe(t, {"lag/position_total": 9_000}) == [] for t in range(124, 132, 2))
    # rising by 10 per 2 s from t = 134: at 134, a = 124, W = 9000 x4, 9010: 1 of 4 steps up (25 %); at 136,
    # a = 126, W = 9000 (126, 128, 130), 9010, 9020: +20, 2 of 4 steps up (50 %): fires
    rising = [a for t in range(134, 144, 2) for a in e.observe(t, {"lag/position_total": 9_000 + 5 * (t - 132)})]
    assert states(rising) == [("consumer_lag", "firing")]
    assert "+20 records over the last 10 s (50% of measurements rising)" in rising[0].message
    assert rising[0].value == 9_020


def test_trainer_stalled_when_step_does_not_increase_for_t_seconds():
    e = engine(trainer_stalled={"stall_s": 60})
    assert e.observe(0, {"step": 0}) == []
    assert e.observe(30, {"step": 1}) == []
    assert e.observe(89, {"step": 1}) == []  # 59 s since the last increase
    fired = e.observe(90, {"step": 1})
    assert states(fired) == [("trainer_stalled", "firing")]
    assert fired[0].threshold == 60
    assert e.observe(120, {}) == []  # no sample: no transition
    assert states(e.observe(121, {"step": 2})) == [("trainer_stalled", "resolved")]

    # only the trainer has this rule (a producer waiting for weights is not a stalled trainer); no data never fires
    p = engine("producer", trainer_stalled={"stall_s": 60})
    assert all(p.observe(t, {"step": 3}) == [] for t in range(0, 600, 30))
    assert all(engine().observe(t, {}) == [] for t in range(0, 600, 30))


def _memory(**kw) -> dict:
    return {"memory_growth": {"window_s": 100, "min_span_s": 50, "min_samples": 5, "max_slope_bytes_per_s": 1000,
                              "min_increase_fraction": 0.8, **kw}}


@pytest.mark.parametrize("key", ["process/rss_bytes", "gpu/allocated_bytes"])
def test_memory_growth_fires_on_a_steady_slope_and_resolves_when_flat(key):
    e = engine("scorer", **_memory())
    for t in range(0, 50, 10):  # 5 samples spanning 40 s: not enough span yet
        assert e.observe(float(t), {key: 1e6 + 2000.0 * t}) == []
    out = e.observe(50.0, {key: 1e6 + 2000.0 * 50})
    assert states(out) == [("memory_growth", "firing")]
    assert out[0].value == pytest.approx(2000.0) and out[0].threshold == 1000 and key in out[0].message
    level = 1e6 + 2000.0 * 50
    resolved = [a for t in range(60, 300, 10) for a in e.observe(float(t), {key: level})]
    assert states(resolved) == [("memory_growth", "resolved")]


def test_memory_growth_not_on_the_bound_slope_nor_on_a_sawtooth():
    e = engine("trainer", **_memory())
    assert all(e.observe(float(t), {"process/rss_bytes": 1000.0 * t}) == [] for t in range(0, 200, 10))  # = bound
    # slope 1500 B/s > bound, but only half the steps go up: not "steady"
    e = engine("trainer", **_memory())
    saw = [3 * v for v in (0, 20000, 10000, 30000, 20000, 40000, 30000, 50000, 40000, 60000, 50000)]
    assert least_squares_slope([(10.0 * i, float(v)) for i, v in enumerate(saw)]) == pytest.approx(1500.0)
    assert all(e.observe(10.0 * i, {"process/rss_bytes": float(v)}) == [] for i, v in enumerate(saw))


def test_dlq_rate_per_minute_over_the_window():
    e = engine("scorer", dlq_rate={"max_per_minute": 10, "window_s": 60})
    assert e.observe(0, {"dlq/total": 0}) == []
    assert e.observe(30, {"dlq/total": 5}) == []
    assert e.observe(60, {"dlq/total": 10}) == []  # 10 per minute: on the bound
    fired = e.observe(61, {"dlq/total": 12})
    assert states(fired) == [("dlq_rate", "firing")] and fired[0].value == 12.0
    assert states(e.observe(121, {"dlq/total": 12})) == [("dlq_rate", "resolved")]  # nothing new for a minute
