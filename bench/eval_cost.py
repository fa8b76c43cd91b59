"""Benchmark 12, the evaluator's cost: the demo pipeline's trainer steps/s without and with the evaluator running.

Consumes: the demo (:func:`bench.demo_runs.demo_dir`) and ``configs/demo.toml`` (its ``[eval]`` section: the
demo's held-out split, n = 8, pass@1/pass@8, greedy, ``max_prompts = 200``).
Produces: per round (the two variants interleaved, at least 3 rounds in the full mode) one pipeline run each, with
the same config and prompts::

    without   trainer, scorer, producer (bench.demo_runs.run_pipeline)
    with      the same, plus `stream-rl evaluate` (pinned with the producer, as `stream-rl run` places it)

Trainer steps/s is measured from the end of trainer step ``skip`` to the end of step ``skip + steps`` (process
start-up, model loading and the evaluation of version 0, which runs while the other roles load, fall before it).
In the full mode the window is 40 steps with the demo's ``eval.every_versions = 20``, so the evaluations of v20 and
v40 fall inside it, as in ``make run``; the quick and tiny modes evaluate more often on fewer prompts (code path
only). Figures: the median steps/s of each variant, their ratio (``with / without``; the issue's bound: the
evaluator may cost the trainer at most 5 %, i.e. a ratio >= 0.95) and the median seconds per evaluation. The
evaluations that finished inside the timed window are counted per run (params).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench import demo_runs as dr
from bench.common import BenchContext, fmt, interleave, medians

TITLE = "Evaluator cost"
VARIANTS = ("without", "with")


def sizes(ctx: BenchContext) -> dict[str, Any]:
    return ctx.pick(full={"skip": 2, "steps": 40, "every_versions": 20, "max_prompts": 200, "deadline_s": 900},
                    quick={"skip": 2, "steps": 6, "every_versions": 2, "max_prompts": 32, "deadline_s": 300},
                    tiny={"skip": 1, "steps": 2, "every_versions": 1, "max_prompts": 4, "deadline_s": 240})


def evaluations(run_dir: Path) -> list[dict]:
    """The rows of the run's ``evals.jsonl`` (none when the evaluator did not run)."""
    from stream_rl.evaluation.ledger import FILE_NAME, read_rows

    return read_rows(run_dir / FILE_NAME)


def in_window(rows: list[dict], evals: list[dict], skip: int, steps: int) -> list[dict]:
    """Evaluations whose row was written between the end of trainer step ``skip`` and of ``skip + steps``
    (``created_at`` of the evaluation against the metric rows' ``time``)."""
    start, end = float(rows[skip - 1]["time"]), float(rows[skip + steps - 1]["time"])
    return [e for e in evals if start <= float(e.get("created_at", 0.0)) <= end]


def run(ctx: BenchContext) -> dict[str, Any]:
    demo = dr.demo_dir(ctx)
    size = sizes(ctx)
    total = size["skip"] + size["steps"]
    counted: dict[str, list[int]] = {v: [] for v in VARIANTS}
    eval_s: list[float] = []
    placements: list[dict[str, int]] = []

    def variant(name: str):
        def measure() -> dict[str, float]:
            cfg = dr.demo_config(ctx, demo, f"bench-eval-{name}", **{
                "trainer.max_steps": total, "eval.every_versions": size["every_versions"],
                "eval.max_prompts": size["max_prompts"], "eval.batch_size": size["max_prompts"]})
            prompts = dr.demo_prompts(demo, cfg.trainer.groups_per_step * (total + 4), cfg.run.group_size)
            result = dr.run_pipeline(ctx, cfg, prompts, "train", size["deadline_s"],
                                     extra=("evaluate",) if name == "with" else ())
            seconds, _, _ = dr.window(result.rows, size["skip"], size["steps"])
            evals = evaluations(result.run_dir)
            counted[name].append(len(in_window(result.rows, evals, size["skip"], size["steps"])))
            eval_s.extend(float(e["elapsed_s"]) for e in evals)
            placements.append(result.placement)
            return {f"{name}_steps_per_s": size["steps"] / seconds}
        return measure

    ctx.log(f"eval cost: without and with the evaluator, {total} steps each, {size['steps']} timed, "
            f"{ctx.rounds} rounds")
    samples = interleave([(v, variant(v)) for v in VARIANTS], ctx.rounds, ctx.log, ctx.min_rounds)
    figures = medians(samples)
    figures["with_over_without"] = figures["with_steps_per_s"] / figures["without_steps_per_s"]
    if eval_s:
        figures["eval_s"] = sorted(eval_s)[len(eval_s) // 2]
    notes = [f"Trainer steps/s from the end of step {size['skip']} to the end of step {total} "
             f"({size['steps']} steps), medians of {ctx.rounds} interleaved rounds; eval.every_versions = "
             f"{size['every_versions']}, eval.max_prompts = {size['max_prompts']}.",
             f"Evaluations finished inside the timed window per run: {json.dumps(counted)}."]
    return {"figures": figures, "samples": {**samples, "eval_s": eval_s}, "notes": notes,
            "params": {**size, "total_steps": total, "evaluations_in_window": counted, "placements": placements,
                       "cores": dr.usable_cores(), "repeats": ctx.rounds}}


def cost_pct(figures: Mapping[str, float]) -> float:
    """The evaluator's cost to the trainer in percent: ``100 * (1 - with / without)`` (negative: noise)."""
    return 100.0 * (1.0 - figures["with_over_without"])


COST_BOUND_PCT = 5.0
"""The most the evaluator may cost the trainer's steps/s, in percent (the issue's bound)."""


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    f = result["figures"]
    counts = result["params"]["evaluations_in_window"]
    cost = cost_pct(f)
    verdict = f"{fmt(cost)} % ({'within' if cost <= COST_BOUND_PCT else 'above'} the {COST_BOUND_PCT:g} % bound)"
    per_eval = fmt(f["eval_s"]) if "eval_s" in f else "–"
    rows = [["without the evaluator", fmt(f["without_steps_per_s"]), "1×", "–", "–", "–"],
            ["with the evaluator", fmt(f["with_steps_per_s"]), f"**{fmt(f['with_over_without'])}×**", verdict,
             ", ".join(map(str, counts["with"])), per_eval]]
    return ["trainer", "steps/s (median)", "vs without", "cost to the trainer", "evaluations in the window, per run",
            "one evaluation, s (median)"], rows


def headline(result: Mapping[str, Any]) -> str:
    f = result["figures"]
    return (f"the evaluator costs the trainer {fmt(cost_pct(f))} % of its steps/s "
            f"({fmt(f['with_steps_per_s'])} vs {fmt(f['without_steps_per_s'])} steps/s; bound: {COST_BOUND_PCT:g} %)")
