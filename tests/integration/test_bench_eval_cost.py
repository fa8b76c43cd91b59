"""Benchmark 12 (the evaluator's cost) stays alive: its tiny code path runs the demo pipeline without and with a real
evaluator process on the real broker and produces every figure, finite and positive, and its report section.
Nothing here asserts a speed (a tiny run on a shared machine means nothing)."""

from __future__ import annotations

import json
import math

import pytest

from bench import eval_cost
from bench import run as bench_run
from bench.common import fmt

FIGURES = {"without_steps_per_s", "with_steps_per_s", "with_over_without"}


def test_cost_and_window_are_computed_from_the_rows():
    rows = [{"time": 10.0}, {"time": 12.0}, {"time": 14.0}, {"time": 16.0}]
    evals = [{"created_at": 11.0}, {"created_at": 13.0}, {"created_at": 16.0}, {"created_at": 17.0}]
    assert eval_cost.in_window(rows, evals, skip=2, steps=2) == evals[1:3]  # from rows[1] (12) to rows[3] (16)
    assert eval_cost.in_window(rows, evals, skip=1, steps=1) == evals[:1]  # 10 .. 12
    assert eval_cost.cost_pct({"with_over_without": 0.96}) == pytest.approx(4.0)
    assert "evalcost" in bench_run.BY_NAME and bench_run.BY_NAME["evalcost"].module == "bench.eval_cost"


@pytest.mark.broker
@pytest.mark.timeout(900)  # tiny: one round, two pipeline launches
def test_tiny_eval_cost_produces_every_figure_and_its_section(broker, demo_build, tmp_path, monkeypatch):
    from bench import demo_runs

    monkeypatch.setenv(demo_runs.DEMO_DIR_ENV, str(demo_build[0]))
    json_path, md_path = tmp_path / "results.json", tmp_path / "benchmarks.md"
    code = bench_run.main(["evalcost", "--tiny", "--bootstrap", broker.bootstrap, "--json", str(json_path),
                           "--out", str(md_path)])
    assert code == 0
    result = json.loads(json_path.read_text())["benchmarks"]["evalcost"]
    figures = result["figures"]
    assert FIGURES <= set(figures), FIGURES - set(figures)
    assert all(math.isfinite(v) and v > 0 for v in figures.values()), figures
    assert figures["with_over_without"] == pytest.approx(figures["with_steps_per_s"] / figures["without_steps_per_s"])
    assert result["params"]["evaluations_in_window"]["without"] == [0]  # no evaluator, no evaluation
    assert result["samples"]["eval_s"], "the evaluator recorded no evaluation"
    doc = md_path.read_text()
    cost = eval_cost.cost_pct(figures)  # the verdict against the 5 % bound is in the table now
    verdict = "within" if cost <= eval_cost.COST_BOUND_PCT else "above"
    assert eval_cost.COST_BOUND_PCT == 5.0
    assert "## 12. Evaluator cost" in doc and f"| {fmt(cost)} % ({verdict} the 5 % bound) |" in doc
