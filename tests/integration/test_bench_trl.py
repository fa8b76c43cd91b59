"""Benchmarks 9, 18 and 19 (TRL's GRPOTrainer against `stream-rl run`) stay alive and stay out of the default run.

The tiny runs need the optional extra (`pip install -e '.[trl]'`) and skip without it, as in CI; the reward
wrapper and the selection tests need no TRL. Nothing here asserts a speed.
"""

from __future__ import annotations

import json
import math

import pytest

from bench import run as bench_run
from bench import trl_frontier, trl_peer, trl_tail
from bench.trl_worker import counted, trl_reward
from stream_rl.demo.task import addition_reward

TIMINGS = ("span_s", "wall_s", "samples_s")


def _tiny(name: str, number: int, broker, demo_build, tmp_path, monkeypatch) -> tuple[dict, str]:
    """Benchmark ``name`` in the tiny mode on the session broker and demo: its result and the rendered document
    (skipped, saying why, without TRL)."""
    pytest.importorskip("trl", reason=f"benchmark {number} needs the optional extra: pip install -e '.[trl]' "
                                      "(not in CI)")
    from bench import demo_runs

    monkeypatch.setenv(demo_runs.DEMO_DIR_ENV, str(demo_build[0]))
    json_path, md_path = tmp_path / "results.json", tmp_path / "benchmarks.md"
    assert bench_run.main([name, "--tiny", "--bootstrap", broker.bootstrap, "--json", str(json_path),
                           "--out", str(md_path)]) == 0
    return json.loads(json_path.read_text())["benchmarks"][name], md_path.read_text()


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.timeout(900)  # tiny: four process launches (TRL and stream-rl run, two workloads)
def test_tiny_trl_peer_produces_every_figure_and_its_section(broker, demo_build, tmp_path, monkeypatch):
    result, doc = _tiny("trl", 9, broker, demo_build, tmp_path, monkeypatch)
    expected = {f"{w}.{s}.{t}" for w in ("short", "long") for s in ("trl", "stream") for t in TIMINGS}
    expected |= {f"short.{s}.reward_{end}" for s in ("trl", "stream") for end in ("first", "last")}
    expected |= {f"{w}.{r}_ratio" for w in ("short", "long") for r in ("span", "wall", "samples_s")}
    figures = result["figures"]
    assert set(figures) == expected  # the untrained workload's rewards are kept out of the figures
    assert all(math.isfinite(v) and v > 0 for v in figures.values()), figures
    assert figures["short.span_ratio"] == figures["short.stream.span_s"] / figures["short.trl.span_s"]
    assert set(result["params"]["rewards"]) == {f"long.{s}.reward_{e}" for s in ("trl", "stream")
                                                for e in ("first", "last")}
    steps = {w["name"]: w["steps"] for w in result["params"]["workloads"]}
    for name, systems in result["curves"].items():
        for system, rounds in systems.items():
            assert len(rounds) == 1 and len(rounds[0]["reward"]) == steps[name], (name, system)
            assert all(0.0 <= r <= 1.0 for r in rounds[0]["reward"])
    assert {"short.trl.generate_s", "short.trl.fwd_bwd_s", "short.stream.train_s"} <= set(result["params"]["stages"])
    assert "## 9. Against TRL" in doc and "**What differs.**" in doc and trl_peer.headline(result) in doc
    png = trl_peer.plot(result, tmp_path / "curves.png")  # the full mode's plot, drawn from the tiny result
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.timeout(900)  # tiny: three process launches (TRL, two stream-rl settings) of two steps each
def test_tiny_staleness_frontier_scores_every_snapshot_and_renders(broker, demo_build, tmp_path, monkeypatch):
    result, doc = _tiny("trlfront", 18, broker, demo_build, tmp_path, monkeypatch)
    assert set(result["figures"]) == {f"{n}.{k}" for n in ("trl", "va2", "va0") for k in ("span_s", "span_ratio")}
    assert all(math.isfinite(v) and v > 0 for v in result["figures"].values())
    for name in ("trl", "va2", "va0"):  # the warm start, then the policy after each of the two steps
        (curve,) = result["heldout_curves"][name]
        assert curve["step"] == [0, 1, 2] and all(0.0 <= a <= 1.0 for a in curve["heldout"])
    starts = {result["heldout_curves"][n][0]["heldout"][0] for n in ("trl", "va2", "va0")}
    assert len(starts) == 1  # one warm start, scored once
    assert "## 18. Staleness frontier against TRL" in doc and trl_frontier.headline(result) in doc


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.timeout(900)  # tiny: the long-tail policy (5 fine-tune steps) and three launches of two steps each
def test_tiny_long_tail_benchmark_runs_both_sides_on_the_tail_policy_and_renders(broker, demo_build, tmp_path,
                                                                               monkeypatch):
    result, doc = _tiny("trltail", 19, broker, demo_build, tmp_path, monkeypatch)
    assert set(result["figures"]) == {f"{n}.{k}" for n in ("trl", "demo", "packed") for k in ("span_s", "span_ratio")}
    assert all(math.isfinite(v) and v > 0 for v in result["figures"].values())
    assert {"packed.update_s", "trl.generate_s"} <= set(result["params"]["stages"])
    assert set(result["params"]["lengths"]) >= {"mean", "p99", "long_share"}
    assert "## 19. Long tails against TRL" in doc and trl_tail.headline(result) in doc


def test_trl_reward_is_the_demo_verifier_on_each_completion():
    prompts = ["12+34=", "12+34=", "12+34=", "99+10=", "99+10=", "50+50="]
    completions = ["46", "47", "46 ", "109", "1090", ""]
    answers = ["46", "46", "46", "109", "109", "100"]
    rewards = trl_reward(prompts, completions, answer=answers, completion_ids=[[0]] * 6, trainer_state=None)
    assert rewards == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # trailing whitespace is stripped, extra digits are wrong
    assert rewards == [addition_reward(p, c, a, {}) for p, c, a in zip(prompts, completions, answers)]
    with pytest.raises(ValueError):
        trl_reward(prompts, completions[:2], answer=answers)  # one reward per completion, never a silent cut


def test_counted_reward_keeps_the_name_trl_logs_it_under_and_counts_completions():
    counts: list[int] = []
    reward = counted(trl_reward, counts)
    assert reward.__name__ == "trl_reward"
    assert reward(prompts=["1+2="] * 2, completions=["3", "4"], answer=["3", "3"]) == [1.0, 0.0]
    assert counts == [2]


def test_trl_runs_only_when_named_and_enters_the_report_once_measured():
    assert "trl" not in [s.name for s in bench_run.select([])]
    assert [s.name for s in bench_run.select(["trl", "transport"])] == ["transport", "trl"]
    assert "trl" not in [s.name for s in bench_run.report_specs({"benchmarks": {}})]
    specs = bench_run.report_specs({"benchmarks": {"trl": {}}})
    assert [s.name for s in specs].count("trl") == 1
    assert [s.number for s in specs] == sorted(s.number for s in specs)  # sections in benchmark order
    assert not {"trlfront", "trltail"} & {s.name for s in bench_run.select([])}  # benchmarks 18, 19 need TRL too
