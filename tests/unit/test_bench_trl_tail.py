"""Benchmark 19 (long tails against TRL, bench.trl_tail): the long-tail workload's reward, its fine-tuning rows and
policy, and the benchmark's figures and report from hand-made samples. The benchmark's runs need TRL (the optional
extra) and are not run here; nothing here asserts a speed."""

from __future__ import annotations

import json

import pytest
import torch

from bench import tail_policy, trl_tail
from bench.trl_worker import parse_args, trl_tail_reward


def test_the_tail_reward_is_the_demo_verifier_without_the_trailing_run():
    assert tail_policy.tail_reward("12+34=", "46", "46", {}) == 1.0
    assert tail_policy.tail_reward("12+34=", "46" + "=" * 40, "46", {}) == 1.0
    assert tail_policy.tail_reward("12+34=", "46===<eos><pad>", "46", {}) == 1.0  # decoded with specials
    assert tail_policy.tail_reward("12+34=", "4=6", "46", {}) == 0.0  # only a trailing run is removed
    assert tail_policy.tail_reward("12+34=", "=46", "46", {}) == 0.0
    assert tail_policy.tail_reward("12+34=", "47" + "=" * 30, "46", {}) == 0.0
    assert trl_tail_reward(["12+34=", "1+1="], ["46=====", "3"], answer=["46", "2"], trainer_state=None) == [1.0, 0.0]


def test_the_fine_tune_rows_keep_each_own_answer_and_give_one_in_ten_a_long_tail():
    rows = [{"text": f"{i % 90 + 10}+1=", "answer": "x"} for i in range(3000)]
    own = ["46<eos><pad>", "7<eos>", "123", "<eos>", "9<pad><pad>"] * 600
    targets = tail_policy.tail_targets(rows, own, torch.Generator().manual_seed(0))
    cores = [t["answer"].rstrip("=") for t in targets]
    assert cores == ["46", "7", "123", "", "9"] * 600 and [t["text"] for t in targets] == [r["text"] for r in rows]
    runs = [len(t["answer"]) - len(c) for t, c in zip(targets, cores)]
    long = [r for r in runs if r]
    assert all(tail_policy.TAIL_MIN <= r <= tail_policy.TAIL_MAX for r in long)
    assert 240 <= len(long) <= 360  # binomial(3000, 0.1): 300, sd 16
    again = tail_policy.tail_targets(rows, own, torch.Generator().manual_seed(0))
    assert again == targets  # seeded


def test_a_built_policy_is_saved_reloadable_and_measured(model_dir, tmp_path):
    demo = model_dir.parent
    rows = [{"prompt_id": str(i), "text": f"{10 + i}+{20 + i}=", "answer": str(30 + 2 * i)} for i in range(16)]
    (demo / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    built = tail_policy.build(demo, tmp_path / "tail", steps=2, samples=16)
    assert (built / "config.json").is_file()
    stamp = (built / "config.json").stat().st_mtime_ns
    assert tail_policy.build(demo, tmp_path / "tail", steps=2, samples=16) == built  # built once, then reused
    assert (built / "config.json").stat().st_mtime_ns == stamp
    shape = tail_policy.lengths(built, demo, prompts=4, group=2)
    assert set(shape) == {"mean", "p50", "p90", "p99", "max", "long_share", "accuracy"}
    assert 1 <= shape["p50"] <= shape["p90"] <= shape["p99"] <= shape["max"] <= tail_policy.MAX_NEW_TOKENS
    assert 0.0 <= shape["long_share"] <= 1.0 and 0.0 <= shape["accuracy"] <= 1.0


SAMPLES = {  # two seeds, by hand
    "trl.span_s": [200.0, 220.0], "trl.reward_first": [0.2, 0.2], "trl.reward_last": [0.3, 0.32],
    "trl.gain": [0.1, 0.12],
    "demo.span_s": [150.0, 160.0], "demo.reward_first": [0.2, 0.2], "demo.reward_last": [0.31, 0.31],
    "demo.gain": [0.11, 0.11],
    "packed.span_s": [100.0, 110.0], "packed.reward_first": [0.2, 0.2], "packed.reward_last": [0.29, 0.29],
    "packed.gain": [0.09, 0.09],
}
NAMES = ["trl", "demo", "packed"]


def _result() -> dict:
    figures, gains = trl_tail.summarise(SAMPLES, NAMES)
    return {"figures": figures, "gains": gains, "samples": SAMPLES,
            "params": {"steps": 60, "settings": {n: {"what": w, "sets": dict(s)} for n, w, s in trl_tail.SETTINGS},
                       "lengths": {"mean": 6.1, "p50": 3, "p90": 35, "p99": 44, "max": 50, "long_share": 0.1,
                                   "accuracy": 0.2},
                       "tail": {"share": 0.1, "min": 30, "max": 44}, "stages": {}}}


def test_figures_and_gains_are_medians_and_ratios_by_hand():
    figures, gains = trl_tail.summarise(SAMPLES, NAMES)
    assert figures["trl.span_s"] == 210.0 and figures["packed.span_ratio"] == pytest.approx(105.0 / 210.0)
    assert gains["trl.gain"] == pytest.approx(0.11) and gains["demo.gain_ratio"] == pytest.approx(1.0)
    assert gains["packed.gain_ratio"] == pytest.approx(0.09 / 0.11)
    flat = {**SAMPLES, "trl.gain": [0.0, -0.01]}
    assert trl_tail.summarise(flat, NAMES)[1]["packed.gain_ratio"] is None


def test_the_report_states_the_goal_per_setting():
    result = _result()
    assert trl_tail.met(result, "demo") is False  # 0.74x the time
    assert trl_tail.met(result, "packed") is False  # 0.5x the time but 0.82x the gain
    result["gains"]["packed.gain_ratio"] = 0.96
    assert trl_tail.met(result, "packed") is True
    header, rows = trl_tail.table(result)
    assert len(header) == len(rows[0]) == 7 and rows[2][2] == "**0.50×**" and rows[2][6] == "met"
    assert rows[1][6] == "not met" and rows[0][6] == "–"
    assert trl_tail.headline(result).startswith("`demo` 0.74× TRL's time at 1.00× its gain; `packed` 0.50×")
    text = trl_tail.reading(result)
    assert "10.0% were over 10 tokens" in text and "met by packed." in text


def test_the_trl_worker_takes_the_tail_reward_by_name(capsys):
    base = ["--demo-dir", "d", "--out", "o.jsonl", "--steps", "3", "--max-new-tokens", "50"]
    assert parse_args([*base, "--reward", "tail"]).reward == "tail"
    assert parse_args(base).reward == "demo"
    with pytest.raises(SystemExit):
        parse_args([*base, "--reward", "judge"])
    assert "invalid choice: 'judge'" in capsys.readouterr().err
