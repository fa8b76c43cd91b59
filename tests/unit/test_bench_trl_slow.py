"""Benchmark 17 (slow rewards against TRL, bench.trl_slow): its figures, gains and report from hand-made samples,
and the two sides' delayed rewards. The benchmark's runs need TRL (the optional extra) and are not run here; nothing
here asserts a speed."""

from __future__ import annotations

import time

import pytest

from bench import delayed_reward, trl_slow
from bench.trl_worker import delayed, trl_reward
from stream_rl.demo.task import addition_reward

SAMPLES = {  # two rounds of one delay, by hand
    "d1000ms.trl.span_s": [100.0, 120.0], "d1000ms.stream.span_s": [40.0, 44.0],
    "d1000ms.trl.reward_first": [0.2, 0.2], "d1000ms.trl.reward_last": [0.4, 0.44],
    "d1000ms.stream.reward_first": [0.2, 0.1], "d1000ms.stream.reward_last": [0.36, 0.34],
}


def test_figures_are_medians_and_the_span_ratio_is_of_the_medians():
    f = trl_slow.figures(SAMPLES, ["d1000ms"])
    assert f["d1000ms.trl.span_s"] == 110.0 and f["d1000ms.stream.span_s"] == 42.0
    assert f["d1000ms.span_ratio"] == pytest.approx(42.0 / 110.0)


def test_gains_are_per_round_then_median_and_the_ratio_is_none_when_trl_gained_nothing():
    g = trl_slow.gains(SAMPLES, ["d1000ms"])
    assert g["d1000ms.trl.gain"] == pytest.approx((0.2 + 0.24) / 2)  # rounds: 0.4-0.2, 0.44-0.2
    assert g["d1000ms.stream.gain"] == pytest.approx((0.16 + 0.24) / 2)  # 0.36-0.2, 0.34-0.1
    assert g["d1000ms.gain_ratio"] == pytest.approx(0.20 / 0.22)
    flat = {**SAMPLES, "d1000ms.trl.reward_last": [0.2, 0.1]}
    assert trl_slow.gains(flat, ["d1000ms"])["d1000ms.gain_ratio"] is None


def test_the_report_states_the_goal_and_whether_it_was_met():
    result = {"figures": trl_slow.figures(SAMPLES, ["d1000ms"]), "gains": trl_slow.gains(SAMPLES, ["d1000ms"]),
              "samples": SAMPLES,
              "params": {"delays_s": [1.0], "steps": 180, "stream_means": dict(trl_slow.STREAM_MEANS),
                         "stages": {}}}
    assert trl_slow.headline(result) == ("reward call 1 s: stream-rl 0.38× TRL's time at 0.91× its reward gain "
                                         "(goal ≤ 0.5×, ≥ 0.9×)")
    assert "is met in this run" in trl_slow.reading(result)
    header, rows = trl_slow.table(result)
    assert rows == [["1 s", "110.0", "42.0", "**0.38×**", "+0.220", "+0.200", "0.91×"]] and len(header) == 7
    assert "vary between rounds" in trl_slow.reading(result)  # the hand-made rounds differ
    result["gains"]["d1000ms.gain_ratio"] = 0.5
    assert "is not met in this run" in trl_slow.reading(result)
    same = {k: [v[0], v[0]] for k, v in SAMPLES.items()}
    assert "identical in every round" in trl_slow.reading({**result, "samples": same})


def test_both_sides_wait_once_per_call_then_score_with_the_demo_verifier(monkeypatch):
    monkeypatch.setenv(delayed_reward.DELAY_ENV, "0.2")
    prompts, responses, answers = ["1+2=", "3+4="], ["3", "8"], ["3", "7"]
    started = time.monotonic()
    assert delayed_reward.delayed_addition(prompts, responses, answers, [{}, {}]) == [1.0, 0.0]
    assert 0.2 <= time.monotonic() - started < 1.0  # once per call, not per rollout
    assert delayed_reward.delayed_addition.batched is True  # one call per scorer batch
    slow = delayed(trl_reward, 0.2)
    started = time.monotonic()
    assert slow(prompts, responses, answer=answers) == [addition_reward(p, r, a, {}) for p, r, a in
                                                        zip(prompts, responses, answers)]
    assert 0.2 <= time.monotonic() - started < 1.0 and slow.__name__ == "trl_reward"
    monkeypatch.delenv(delayed_reward.DELAY_ENV)
    assert delayed_reward.delay_s() == 0.0


def test_workloads_cover_the_issues_four_delays_in_the_full_mode():
    class Ctx:
        mode = "full"

        def pick(self, full, quick, tiny):
            return full

    loads = trl_slow.workloads(Ctx())
    assert [w.reward_delay_s for w in loads] == [0.1, 0.3, 1.0, 3.0] and {w.steps for w in loads} == {180}
    assert all(dict(w.stream_sets)["scorer.batches_in_flight"] == 16 for w in loads)
