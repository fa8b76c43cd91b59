"""Benchmark 2, pipeline efficiency: each stage of the demo alone against the streaming pipeline, in trained tokens/s.

Consumes: the demo (:func:`bench.demo_runs.demo_dir`, built once per invocation) and ``configs/demo.toml``.
Produces: per round (interleaved, at least 3 rounds)::

    generate alone   HF engine, ``steps`` batches of 32 prompts x 8 samples            -> response tokens/s
    score alone      reward fn + reward model (weight 0) + reference logprobs, batch 256 -> response tokens/s
    train alone      build_batch + rollout_metrics + train_step on those scored rollouts -> response tokens/s
    train_always     the same with ``trainer.recompute_proximal = "always"`` (a separate proximal pass before
                     the demo's single update, the path before it was skipped)             -> response tokens/s
    pipeline         producer, scorer and trainer as processes (Supervisor, demo config) -> trained response
                     tokens/s between the end of step ``skip`` and the end of step ``skip + steps``

All four count the same unit, response tokens, so the pipeline's figure can be divided by the slowest stage's.
Stages run in this process on one torch thread (each role process runs with ``OMP_NUM_THREADS=1``). Pipeline roles
are pinned once training has started: the slowest stage alone (as measured in the rounds so far) gets a core to
itself and the other two roles share the second core (three roles on two cores); with three or more cores each
role has its own. The broker and this process are not pinned. Warm-up steps (``versions_ahead + 2``; one in the tiny
mode) are skipped: the first steps drain the rollouts generated while the trainer was still loading.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from bench import demo_runs as dr
from bench.common import BenchContext, fmt, interleave, medians

TITLE = "Pipeline efficiency"
STAGES = ("generate", "score", "train")


def sizes(ctx: BenchContext) -> dict[str, int]:
    """Trainer steps per stage sample, measured pipeline steps, and the per-run deadline."""
    return ctx.pick(full={"stage_steps": 3, "steps": 8, "deadline_s": 300},
                    quick={"stage_steps": 2, "steps": 4, "deadline_s": 240},
                    tiny={"stage_steps": 1, "steps": 1, "deadline_s": 240})


def run(ctx: BenchContext) -> dict[str, Any]:
    demo = dr.demo_dir(ctx)
    size = sizes(ctx)
    cfg = dr.demo_config(ctx, demo, "bench-stages")
    warm_up = cfg.producer.versions_ahead + 2
    skip = ctx.pick(full=warm_up, quick=warm_up, tiny=1)  # tiny: the code path only, one step skipped
    samples: dict[str, list[float]] = {}
    rounds: list[dict[str, Any]] = []

    def pipeline() -> dict[str, float]:
        alone = _slowest(samples) if samples else "train"
        run_cfg = dr.demo_config(ctx, demo, "bench-pipeline", **{"trainer.max_steps": skip + size["steps"]})
        per_step = run_cfg.trainer.groups_per_step
        prompts = dr.demo_prompts(demo, per_step * (skip + size["steps"] + 2), run_cfg.run.group_size)
        result = dr.run_pipeline(ctx, run_cfg, prompts, alone, size["deadline_s"])
        seconds, tokens, _ = dr.window(result.rows, skip, size["steps"])
        span = result.rows[skip:skip + size["steps"]]
        rounds.append({"placement": result.placement, "stale": result.stale})
        return {"pipeline_tokens_s": tokens / seconds, "pipeline_step_s": seconds / size["steps"],
                "pipeline_trainer_busy": sum(r["time/step_s"] for r in span) / seconds,
                "pipeline_trainer_work_s": statistics.median(r["time/step_s"] - r["time/broadcast_s"] for r in span),
                "pipeline_train_step_s": statistics.median(r["time/train_s"] for r in span),
                "pipeline_broadcast_s": statistics.median(r["time/broadcast_s"] for r in span)}

    ctx.log(f"pipeline: stages alone ({size['stage_steps']} steps each), then the pipeline ({skip} + "
            f"{size['steps']} steps), {ctx.rounds} rounds")
    stages = dr.Stages(cfg, demo, size["stage_steps"])
    try:
        with dr.one_thread():
            steps = [(name, getattr(stages, name)) for name in (*STAGES, "train_always")]
            samples.update(interleave(steps + [("pipeline", pipeline)], ctx.rounds, ctx.log, ctx.min_rounds))
    finally:
        stages.close()
    dr.remember_stages(ctx, samples)
    figures = _figures(medians(samples))
    return {"figures": figures, "samples": samples,
            "notes": _notes(rounds, skip),
            "params": {"stage_steps": size["stage_steps"], "pipeline_steps": size["steps"], "skip_steps": skip,
                       "groups_per_step": cfg.trainer.groups_per_step, "group_size": cfg.run.group_size,
                       "max_new_tokens": cfg.producer.max_new_tokens, "scorer_batch_size": cfg.scorer.batch_size,
                       "versions_ahead": cfg.producer.versions_ahead, "max_lag": cfg.trainer.max_lag,
                       "cores": dr.usable_cores(), "rounds": rounds, "repeats": ctx.rounds}}


def _slowest(samples: Mapping[str, list[float]]) -> str:
    return min(STAGES, key=lambda s: statistics.median(samples[f"{s}_tokens_s"]))


def _figures(med: Mapping[str, float]) -> dict[str, float]:
    figures = dict(med)
    slowest = min(STAGES, key=lambda s: med[f"{s}_tokens_s"])
    figures["slowest_stage_tokens_s"] = med[f"{slowest}_tokens_s"]
    figures["pipeline_vs_slowest"] = med["pipeline_tokens_s"] / med[f"{slowest}_tokens_s"]
    figures["pipeline_train_vs_alone"] = med["pipeline_trainer_work_s"] / med["train_step_s"]
    figures["train_skip_proximal_speedup"] = med["train_tokens_s"] / med["train_always_tokens_s"]
    return figures


def _notes(rounds: list[dict[str, Any]], skip: int) -> list[str]:
    where = rounds[-1]["placement"] if rounds else {}
    stale = sum(r["stale"] for r in rounds)
    return [f"Cores (last round): {', '.join(f'{role} on core {core}' for role, core in where.items())}; the "
            f"broker and the benchmark process are not pinned.",
            f"The pipeline runs `configs/demo.toml` plus the reward model at weight 0 (its cost is paid, the reward "
            f"is the verifier's); the first {skip} steps of each run are skipped; {stale} rollouts went stale."]


def slowest_name(figures: Mapping[str, float]) -> str:
    return min(STAGES, key=lambda s: figures[f"{s}_tokens_s"])


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    f = result["figures"]
    rows = [[f"{stage} alone", fmt(f[f"{stage}_tokens_s"]), fmt(f[f"{stage}_step_s"]),
             fmt(f[f"{stage}_tokens_s"] / f["slowest_stage_tokens_s"]) + "×"] for stage in STAGES]
    rows.append(["**pipeline** (3 processes)", fmt(f["pipeline_tokens_s"]), fmt(f["pipeline_step_s"]),
                 f"**{fmt(f['pipeline_vs_slowest'])}×**"])
    return ["stage", "response tokens/s", "s per trainer step (256 rollouts)", "÷ slowest stage"], rows


def headline(result: Mapping[str, Any]) -> str:
    f = result["figures"]
    return (f"pipeline {fmt(f['pipeline_tokens_s'])} tokens/s = {fmt(f['pipeline_vs_slowest'])}× the slowest "
            f"stage alone ({slowest_name(f)})")


def reading(result: Mapping[str, Any]) -> str:
    f = result["figures"]
    slow = slowest_name(f)
    work, cast = f["pipeline_trainer_work_s"], f["pipeline_broadcast_s"]
    return (
        f"Alone, on one thread each, the slowest stage is **{slow}** ({fmt(f['slowest_stage_tokens_s'])} tokens/s; "
        f"generate {fmt(f['generate_tokens_s'])}, score {fmt(f['score_tokens_s'])}, train "
        f"{fmt(f['train_tokens_s'])}; with the separate proximal pass that one update per batch does not need, "
        f"train would be {fmt(f['train_always_tokens_s'])}, so skipping it makes the step "
        f"{fmt(f['train_skip_proximal_speedup'])}× as fast). The streaming pipeline trains "
        f"{fmt(f['pipeline_tokens_s'])} tokens/s, "
        f"**{fmt(f['pipeline_vs_slowest'])}×** that stage (1.0 would mean the pipeline costs nothing beyond its "
        f"slowest stage). Where the rest goes: (1) the trainer's work per step (batch, metrics, `train_step`, "
        f"bookkeeping) took {fmt(f['pipeline_train_vs_alone'])}× its time alone ({fmt(work)} s against "
        f"{fmt(f['train_step_s'])} s; `train_step` itself {fmt(f['pipeline_train_step_s'])} s){_own_work(f)}; "
        f"(2) every step publishes the 4.2 MB policy inline, {fmt(cast)} s, {fmt(100 * cast / (work + cast))}% of "
        f"the trainer's busy time; (3) the trainer was busy {fmt(100 * f['pipeline_trainer_busy'])}% of the wall "
        f"time and waited for scored groups the rest: generation and scoring (the reference and reward models: "
        f"two full forward passes per rollout) share the second core, so the fetch, generation and scoring of a "
        f"step must fit inside one trainer step on half the machine. What would fix it: a core per role and "
        f"nothing else on the trainer's core (on a larger machine the ratio is bounded by the slowest stage, not by "
        f"core sharing), a broadcast every few steps (fewer publishes, more slack for the producer, at the price of "
        f"staler rollouts), and a cheaper scorer. The "
        f"machine is shared and noisy: absolute figures moved between rounds (see the samples in "
        f"`bench/results.json`); compare the ratios.")


def _own_work(f: Mapping[str, Any]) -> str:
    """Why the trainer's own work per step differs inside the pipeline from alone, by which way it went."""
    if f["pipeline_train_vs_alone"] > 1.0:
        return (": longer, since its core is pinned but not private (the broker, this benchmark and the machine's "
                "other jobs run on it too) and the per-step bookkeeping alone does not have (a span linked to every "
                "rollout, the trained-ids line, the batcher) adds to it")
    return ": not longer, so the trainer's own work is not where the pipeline loses"
