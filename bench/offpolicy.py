"""Benchmark 5, off-policy robustness: final reward on the demo task against staleness, correction on and off.

Consumes: a :class:`~bench.common.BenchContext` (size mode, scratch directory; the broker is not used) and the
built demo (:func:`bench.demo_runs.demo_dir`: built once per invocation, or ``$BENCH_DEMO_DIR``).
Produces: the benchmark result (see :mod:`bench`): per staleness ``lag`` and loss variant, the median over seeds of
the final policy's reward on held-out prompts and of the training reward over the last steps; the per-seed values
as samples; the loss diagnostics (clip fraction, importance weights) and the paired per-seed differences.
Guarantees: every (lag, variant) runs with the same seeds and a fixed sample budget (steps x prompts x group);
runs happen in-process with the pipeline's pure steps (:mod:`bench.inproc`): no Kafka, no timing in any figure.
At lag 0 the three variants are the same update (mu = pi_prox up to float rounding, so the ratio is 1 and the
importance weight 1): lag 0 runs once, as ``decoupled``, and is the reference of every variant.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.common import BenchContext, fmt, md_table
from bench.inproc import VARIANTS, LoopSpec, run_loop

LABELS = {"decoupled": "decoupled (correction on)", "uncorrected": "correction off",
          "ppo_mu": "plain PPO vs mu (AReaL baseline)"}


def sizes(ctx: BenchContext) -> dict[str, Any]:
    return {
        "lags": ctx.pick([0, 2, 4, 8], [0, 4], [0, 2]),
        "seeds": [0, 1, 2],
        "variants": list(VARIANTS),
        "steps": ctx.pick(24, 8, 2),
        "prompts_per_step": ctx.pick(16, 8, 8),
        "group_size": ctx.pick(8, 8, 4),
        "eval_prompts": ctx.pick(804, 200, 64),
        "last_k": ctx.pick(6, 3, 2),
        "threads": 1,
    }


def runs(params: dict[str, Any]) -> list[tuple[int, str]]:
    """The (lag, variant) pairs of one seed: lag 0 once (the variants coincide there), correction on and off at
    every lag > 0, and plain PPO against mu at the largest lag."""
    top = max(params["lags"])
    return [(lag, variant) for lag in params["lags"]
            for variant in (["decoupled"] if lag == 0 else ["decoupled", "uncorrected"] + (["ppo_mu"] if lag == top
                                                                                           else []))]


def _one(demo, tcfg, params: dict[str, Any], lag: int, variant: str, seed: int, samples, diagnostics, log) -> None:
    spec = LoopSpec(steps=params["steps"], prompts_per_step=params["prompts_per_step"],
                    group_size=params["group_size"], lag=lag, variant=variant, seed=seed,
                    eval_prompts=params["eval_prompts"])
    out = run_loop(demo, tcfg, spec, eval_start=lag == 0)
    key = f"lag{lag}.{variant}"
    last = out.train_rewards[-params["last_k"]:]
    samples.setdefault(f"{key}.final_reward", []).append(out.eval_reward)
    samples.setdefault(f"{key}.train_reward_last", []).append(sum(last) / len(last))
    if out.start_eval_reward is not None:
        samples.setdefault("start_reward", []).append(out.start_eval_reward)
    for name, value in out.diagnostics.items():
        diagnostics.setdefault(key, {}).setdefault(name, []).append(value)
    log(f"  seed {seed} lag {lag} {variant}: final {out.eval_reward:.3f}, last-{params['last_k']} train "
        f"{sum(last) / len(last):.3f} ({out.seconds:.1f} s)")


def run(ctx: BenchContext) -> dict[str, Any]:
    import torch

    from bench.demo_runs import demo_config, demo_dir

    demo = demo_dir(ctx)
    tcfg = demo_config(ctx, demo, "offpolicy").trainer
    params = sizes(ctx)
    samples: dict[str, list[float]] = {}
    diagnostics: dict[str, dict[str, list[float]]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(params["threads"])  # 2 threads on a shared 2-core machine thrash (measured: ~10x slower)
    try:
        for seed in params["seeds"]:  # seed-major: a slow phase of the machine hits every variant, not one
            for lag, variant in runs(params):
                _one(demo, tcfg, params, lag, variant, seed, samples, diagnostics, ctx.log)
    finally:
        torch.set_num_threads(threads)
    figures = {name: float(statistics.median(values)) for name, values in samples.items()}
    params["loss"] = {k: v for k, v in tcfg.loss.model_dump().items() if k != "off_policy_correction"}
    params.update(lr=tcfg.lr, epochs=tcfg.epochs, minibatches=tcfg.minibatches, max_new_tokens=6)
    notes = [f"In-process (no Kafka): {params['steps']} steps of {params['prompts_per_step']} prompts x "
             f"{params['group_size']} samples per run, seeds {params['seeds']}, one torch thread; generation with the "
             "policy exactly `lag` versions old (version 0 for the first `lag` steps); final reward = the final "
             f"policy's accuracy on {params['eval_prompts']} held-out prompts, one sample each at temperature 1; "
             "every figure is the median over seeds."]
    return {"figures": figures, "samples": samples, "params": params, "notes": notes,
            "diagnostics": {k: {n: float(statistics.median(v)) for n, v in d.items()} for k, d in diagnostics.items()}}


# ---------------------------------------------------------------- report


def _value(result: dict[str, Any], lag: int, variant: str, what: str = "final_reward") -> float | None:
    key = f"lag{lag}.{'decoupled' if lag == 0 else variant}.{what}"
    return result["figures"].get(key)


def paired_difference(result: dict[str, Any], lag: int, variant: str, other: str = "decoupled",
                      what: str = "final_reward") -> tuple[float, float, float] | None:
    """Median, min and max over seeds of ``other - variant`` at ``lag`` (same seed, same prompts)."""
    a = result["samples"].get(f"lag{lag}.{other}.{what}")
    b = result["samples"].get(f"lag{lag}.{variant}.{what}")
    if a is None or b is None:
        return None
    diffs = [x - y for x, y in zip(a, b)]
    return statistics.median(diffs), min(diffs), max(diffs)


def _spread(result: dict[str, Any], key: str) -> str:
    values = result["samples"].get(key)
    return f"{min(values):.2f}–{max(values):.2f}" if values else "–"


def _diff_cell(diff: tuple[float, float, float] | None) -> str:
    if diff is None:
        return "–"
    med, low, high = diff
    return f"{med:+.3f} ({low:+.2f} … {high:+.2f})"


def table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["lag", "variant", "final reward (median)", "seed range", "train reward, last steps",
               "correction on − this, per seed: median (min … max)", "correction on vs this", "PPO clip frac",
               "IS weights capped"]
    rows = [["–", "warm-start policy (before RL)", fmt(result["figures"]["start_reward"]),
             _spread(result, "start_reward"), "–", "–", "–", "–", "–"]]
    for lag, variant in runs(result["params"]):
        key = f"lag{lag}.{variant}"
        diag = result.get("diagnostics", {}).get(key, {})
        label = "all three (identical at lag 0)" if lag == 0 else LABELS[variant]
        diff = paired_difference(result, lag, variant) if variant != "decoupled" else None
        rows.append([str(lag), label, fmt(result["figures"][f"{key}.final_reward"]),
                     _spread(result, f"{key}.final_reward"), fmt(result["figures"][f"{key}.train_reward_last"]),
                     _diff_cell(diff), verdict(diff), f"{diag['clipfrac']:.3f}" if "clipfrac" in diag else "–",
                     f"{diag['is_clipped_frac']:.4f}" if "is_clipped_frac" in diag else "–"])
    return headers, rows


def headline(result: dict[str, Any]) -> str:
    lag = max(result["params"]["lags"])
    on, off, ppo = (_value(result, lag, v) for v in ("decoupled", "uncorrected", "ppo_mu"))
    return (f"held-out reward at lag {lag}: {fmt(on)} corrected, {fmt(off)} uncorrected, {fmt(ppo)} plain PPO vs mu "
            f"(lag 0: {fmt(_value(result, 0, 'decoupled'))}, before RL: {fmt(result['figures']['start_reward'])}; "
            f"median of {len(result['params']['seeds'])} seeds)")


def verdict(diff: tuple[float, float, float] | None) -> str:
    """Whether correction on beats this variant on every seed, loses on every seed, or neither."""
    if diff is None:
        return "–"
    _, low, high = diff
    return "better on every seed" if low > 0 else "worse on every seed" if high < 0 else "within the seed noise"


def more_tables(result: dict[str, Any]) -> str:
    """The settings of every run, and whether lag 0 learned beyond the seed spread."""
    p = result["params"]
    start, zero = result["samples"]["start_reward"], result["samples"]["lag0.decoupled.final_reward"]
    gains = [b - a for a, b in zip(start, zero)]
    rows = [["update", f"epochs {p['epochs']}, minibatches {p['minibatches']}, clip {p['loss']['clip_low']}, "
                       f"IS cap {p['loss']['is_cap']}, lr {p['lr']}"],
            ["budget per run", f"{p['steps']} steps, answers of at most {p['max_new_tokens']} tokens, "
                               f"{len(p['seeds'])} seeds"],
            ["lag 0 gain over the warm start, per seed", f"{min(gains):+.3f} … {max(gains):+.3f} (learned beyond "
                                                         f"the seed spread: {'yes' if min(gains) > 0 else 'no'})"]]
    return md_table(["runs", ""], rows)
