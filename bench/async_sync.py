"""Benchmark 3, asynchronous vs synchronous: the demo pipeline lock-step against streaming with ``max_lag`` 1, 2, 4.

Consumes: the demo (:func:`bench.demo_runs.demo_dir`) and ``configs/demo.toml``; the stage timings of benchmark 2
when it ran in the same invocation (else they are measured here, the same way).
Produces: per round (variants interleaved, at least 3 rounds) one pipeline run per variant::

    lock-step   trainer.max_lag = 0, producer.versions_ahead = 0: the producer generates one step's groups
                (max_groups_per_version = groups_per_step = 32), then waits for the next version
    lag k       trainer.max_lag = k, producer.versions_ahead = k (k = 1, 2, 4)

Every run trains the same number of steps (``skip + steps``). Wall time to a fixed number of trained samples is
measured from the end of trainer step ``skip`` to the end of step ``skip + steps`` (``steps x 256`` rollouts), with
``skip = max(k) + 2``: this leaves out process start-up and model loading, and the first steps, which drain the
rollouts a producer ``k`` versions ahead generated while the trainer was still loading (they would flatter
streaming); the tiny mode, which checks the code path only, skips one step. Reward reached: mean ``reward/mean``
over the last ``steps`` trainer steps. Stale drops are counted from the trainer's batcher (a lock-step run must have
none).

Lock-step really is lock-step: with ``versions_ahead = 0`` the producer's budget at version v is
``(v - v0 + 1) * 32`` groups (:class:`producers.budget.Budget`), so it generates one step's 32 groups and polls
the weights topic until version v+1 appears; the trainer takes exactly 32 groups per step and publishes v+1 after
it. A poll may return fewer than 32 prompts and the next one may overshoot the budget; such overshoot is what the
stale count would show.

Ideal speed-up on this machine: ``min(cores, sum of stage times per step / largest stage time)``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from bench import demo_runs as dr
from bench.common import BenchContext, fmt, interleave, medians

TITLE = "Asynchronous vs synchronous"
STAGES = ("generate", "score", "train")


def sizes(ctx: BenchContext) -> dict[str, Any]:
    return ctx.pick(full={"lags": (1, 2, 4), "steps": 6, "stage_steps": 3, "deadline_s": 300},
                    quick={"lags": (2,), "steps": 3, "stage_steps": 2, "deadline_s": 240},
                    tiny={"lags": (1,), "steps": 1, "stage_steps": 1, "deadline_s": 240})


def variant_overrides(lag: int) -> dict[str, int]:
    """Lock-step for lag 0; streaming with the producer ``lag`` versions ahead and the same staleness bound."""
    return {"trainer.max_lag": lag, "producer.versions_ahead": lag}


def label(lag: int) -> str:
    return "lockstep" if lag == 0 else f"lag{lag}"


def run(ctx: BenchContext) -> dict[str, Any]:
    demo = dr.demo_dir(ctx)
    size = sizes(ctx)
    lags = (0, *size["lags"])
    warm_up = max(lags) + 2
    skip = ctx.pick(full=warm_up, quick=warm_up, tiny=1)  # tiny: the code path only, one step skipped
    total = skip + size["steps"]
    stale: dict[str, list[int]] = {label(lag): [] for lag in lags}
    placements: list[dict[str, int]] = []
    base_cfg = dr.demo_config(ctx, demo, "bench-async-stages")
    stage, reused = dr.stage_samples(ctx, base_cfg, demo, size["stage_steps"])
    alone = min(STAGES, key=lambda s: statistics.median(stage[f"{s}_tokens_s"]))

    def variant(lag: int):
        def measure() -> dict[str, float]:
            cfg = dr.demo_config(ctx, demo, f"bench-{label(lag)}",
                                 **{"trainer.max_steps": total, **variant_overrides(lag)})
            prompts = dr.demo_prompts(demo, cfg.trainer.groups_per_step * (total + lag + 2), cfg.run.group_size)
            result = dr.run_pipeline(ctx, cfg, prompts, alone, size["deadline_s"])
            seconds, _, _ = dr.window(result.rows, skip, size["steps"])
            stale[label(lag)].append(result.stale)
            placements.append(result.placement)
            return {f"{label(lag)}_wall_s": seconds,
                    f"{label(lag)}_reward": dr.mean_of(result.rows, "reward/mean", size["steps"]),
                    f"{label(lag)}_lag_mean": 1.0 + dr.mean_of(result.rows, "staleness/mean_lag", size["steps"])}
        return measure

    ctx.log(f"async: lock-step and lag {', '.join(map(str, size['lags']))}: {total} steps each, {size['steps']} "
            f"timed, {ctx.rounds} rounds")
    samples = interleave([(label(lag), variant(lag)) for lag in lags], ctx.rounds, ctx.log, ctx.min_rounds)
    figures = _figures(medians(samples), medians(stage), lags, len(dr.usable_cores()))
    per_step = base_cfg.trainer.groups_per_step * base_cfg.run.group_size
    notes = [f"Wall time from the end of trainer step {skip} to the end of step {total}: {size['steps']} steps = "
             f"{size['steps'] * per_step} trained rollouts; reward: mean over those last {size['steps']} steps.",
             "Stale rollouts dropped per run: "
             + "; ".join(f"{name} {counts}" for name, counts in stale.items()) + ".",
             f"Stage times {'from benchmark 2 of this invocation' if reused else 'measured here'}; "
             f"`*_lag_mean` is 1 + the mean staleness (versions) of the trained rollouts."]
    return {"figures": figures, "samples": {**samples, **{f"stage.{k}": v for k, v in stage.items()}},
            "notes": notes,
            "params": {"lags": list(lags), "steps": size["steps"], "skip_steps": skip, "total_steps": total,
                       "rollouts_per_step": per_step, "stage_steps": size["stage_steps"],
                       "stages_reused": reused, "stale": stale, "placements": placements,
                       "cores": dr.usable_cores(), "repeats": ctx.rounds}}


def _figures(med: Mapping[str, float], stage: Mapping[str, float], lags: tuple[int, ...],
             cores: int) -> dict[str, float]:
    figures = dict(med)
    for lag in lags[1:]:
        figures[f"{label(lag)}_speedup"] = med["lockstep_wall_s"] / med[f"{label(lag)}_wall_s"]
    times = [stage[f"{s}_step_s"] for s in STAGES]
    figures.update({f"{s}_step_s": stage[f"{s}_step_s"] for s in STAGES})
    figures["stage_sum_over_max"] = sum(times) / max(times)
    figures["ideal_speedup"] = min(float(cores), sum(times) / max(times))
    return figures


def _lags(result: Mapping[str, Any]) -> list[int]:
    return [lag for lag in result["params"]["lags"] if lag > 0]


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    f, steps = result["figures"], result["params"]["steps"]
    per_step = result["params"]["rollouts_per_step"]
    stale = result["params"]["stale"]

    def row(label: str, key: str, speedup: str) -> list[str]:
        dropped = stale.get(key, [])
        return [label, fmt(f[f"{key}_wall_s"]), speedup, fmt(f[f"{key}_reward"]),
                f"{sum(dropped)} ({', '.join(map(str, dropped))})", fmt(f[f"{key}_lag_mean"] - 1)]

    rows = [row("lock-step (`max_lag=0`)", "lockstep", "1×")]
    rows += [row(f"streaming `max_lag={lag}`", f"lag{lag}", f"**{fmt(f[f'lag{lag}_speedup'])}×**")
             for lag in _lags(result)]
    rows.append(["ideal on this machine", "–", f"{fmt(f['ideal_speedup'])}×", "–", "–", "–"])
    return ["mode", f"s for {steps * per_step} trained rollouts", "speed-up vs lock-step",
            f"mean reward, last {steps} steps", "stale rollouts dropped (per run)",
            "mean staleness of the trained rollouts (versions)"], rows


def headline(result: Mapping[str, Any]) -> str:
    f = result["figures"]
    best = max(_lags(result), key=lambda lag: f[f"lag{lag}_speedup"])
    return (f"streaming `max_lag={best}` {fmt(f[f'lag{best}_speedup'])}× lock-step (ideal "
            f"{fmt(f['ideal_speedup'])}×)")


def more_tables(result: Mapping[str, Any]) -> str:
    """The stages alone per step, from which the ideal speed-up is computed."""
    f, params = result["figures"], result["params"]
    return ("| per step, alone | generate | score | train | sum ÷ largest | usable cores | ideal speed-up |\n"
            "|---|---|---|---|---|---|---|\n"
            f"| seconds | {fmt(f['generate_step_s'])} | {fmt(f['score_step_s'])} | {fmt(f['train_step_s'])} | "
            f"{fmt(f['stage_sum_over_max'])}× | {len(params['cores'])} | {fmt(f['ideal_speedup'])}× |\n\n"
            f"Every run trained the same {params['total_steps']} steps from the same warm-started policy.")
