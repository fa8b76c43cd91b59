"""Benchmark 17, slow rewards against TRL: the demo with a reward service whose every call takes 0.1, 0.3, 1 or 3 s,
TRL's ``GRPOTrainer`` against ``stream-rl run``, side by side (issue 43, section 1).

Consumes: benchmark 9's two runners (:mod:`bench.trl_peer`: the same demo, model, prompts, verifier, matched
settings and step rows) and ``trl`` (the optional extra ``.[trl]``).
Produces: per round (the order of the two systems alternates) and per delay ``d``, one run of each system on the
demo's budget in which every reward call first waits ``d`` (one call per batch: TRL makes one per step of 256
completions, :func:`bench.trl_worker.delayed`; stream-rl one per scorer batch, :mod:`bench.delayed_reward`).
Each side uses its own path for such a reward: TRL a reward function that waits (its async reward functions run
concurrently with each other, not with generation or training, so one reward gains nothing from them); stream-rl
a batched reward with the scorer's documented means, ``scorer.batches_in_flight`` (batches whose reward calls are in
flight at once) and ``scorer.reward_concurrency`` (:data:`STREAM_MEANS`), everything else the demo's.
Figures per delay (medians over rounds): each system's span (first to last step) and reward gain (mean reward of
the last 10 % of steps less the first 10 %), and the ratios stream-rl / TRL: ``span_ratio`` (the issue's goal at
1 s: at most 0.5) and ``gain_ratio`` (at least 0.9).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bench import demo_runs as dr
from bench import trl_peer as peer
from bench.common import BenchContext

DELAYS_S = (0.1, 0.3, 1.0, 3.0)
STREAM_MEANS = (("scorer.batches_in_flight", 16), ("scorer.reward_concurrency", 16))
GOAL = {"delay_s": 1.0, "span_ratio": 0.5, "gain_ratio": 0.9}  # issue 43: at most 0.5x the time, 0.9x the gain


def label(delay_s: float) -> str:
    return f"d{round(delay_s * 1000)}ms"


def workloads(ctx: BenchContext) -> list[peer.Workload]:
    steps = ctx.pick(full=peer.DEMO_STEPS, quick=8, tiny=3)
    delays = ctx.pick(full=DELAYS_S, quick=DELAYS_S, tiny=(0.1,))
    return [peer.Workload(label(d), 6, steps, False, f"the demo, every reward call {d:g} s", reward_delay_s=d,
                          stream_sets=STREAM_MEANS) for d in delays]


def run(ctx: BenchContext) -> dict[str, Any]:
    peer.require_trl("17 (trlslow)")
    demo = dr.demo_dir(ctx)
    loads = workloads(ctx)
    samples: dict[str, list[float]] = {}
    stages: dict[str, list[float]] = {}
    for w, system, trace in peer.traces(ctx, demo, loads):
        peer.collect(samples, f"{w.name}.{system}", {**trace.timings(), **trace.reward_ends()})
        peer.collect(stages, f"{w.name}.{system}", trace.stages)
    names = [w.name for w in loads]
    return {"figures": figures(samples, names), "samples": samples, "gains": gains(samples, names),
            "notes": [f"Workload {w.name}: {w.what}, {w.steps} optimizer steps of 256 rollouts." for w in loads],
            "params": {"delays_s": [w.reward_delay_s for w in loads], "steps": loads[0].steps,
                       "rounds": ctx.rounds, "stream_means": dict(STREAM_MEANS), "goal": GOAL,
                       "trl_threads": peer.TRL_THREADS, "cores": dr.usable_cores(),
                       "stages": {k: float(statistics.median(v)) for k, v in stages.items()}}}


def figures(samples: Mapping[str, Sequence[float]], names: Sequence[str]) -> dict[str, float]:
    """Medians of every sample, and per workload ``span_ratio``: stream-rl's median span / TRL's."""
    out = {name: float(statistics.median(values)) for name, values in samples.items()}
    for n in names:
        out[f"{n}.span_ratio"] = out[f"{n}.stream.span_s"] / out[f"{n}.trl.span_s"]
    return out


def gains(samples: Mapping[str, Sequence[float]], names: Sequence[str]) -> dict[str, float | None]:
    """Per workload and system the median over rounds of the reward gain (``reward_last - reward_first`` of each
    round), and ``gain_ratio``: stream-rl's median gain / TRL's (None when TRL's is not positive). Kept apart from
    the figures, which must be positive: a gain may be 0 or negative."""
    out: dict[str, float | None] = {}
    for n in names:
        for system in peer.SYSTEMS:
            rounds = zip(samples[f"{n}.{system}.reward_last"], samples[f"{n}.{system}.reward_first"], strict=True)
            out[f"{n}.{system}.gain"] = float(statistics.median(last - first for last, first in rounds))
        trl = out[f"{n}.trl.gain"]
        out[f"{n}.gain_ratio"] = out[f"{n}.stream.gain"] / trl if trl and trl > 0 else None  # type: ignore[operator]
    return out


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["reward call", "TRL span (s)", "stream-rl span (s)", "time: stream / TRL", "TRL gain",
              "stream-rl gain", "gain: stream / TRL"]
    f, g, rows = result["figures"], result["gains"], []
    for d in result["params"]["delays_s"]:
        n = label(d)
        rows.append([f"{d:g} s", f"{f[f'{n}.trl.span_s']:.1f}", f"{f[f'{n}.stream.span_s']:.1f}",
                     f"**{f[f'{n}.span_ratio']:.2f}×**", f"{g[f'{n}.trl.gain']:+.3f}",
                     f"{g[f'{n}.stream.gain']:+.3f}", _ratio(g[f"{n}.gain_ratio"])])
    return header, rows


def _sameness(result: Mapping[str, Any]) -> str:
    """Whether each system's reward ends were the same in every round and at every delay (each run is seeded)."""
    samples, delays = result["samples"], result["params"]["delays_s"]
    same = {system: len({round(v, 9) for d in delays for end in ("reward_first", "reward_last")
                         for v in samples[f"{label(d)}.{system}.{end}"]}) == 2 for system in peer.SYSTEMS}
    if not all(same.values()):
        return ("The reward gains vary between rounds: the ratio is of the medians, and the variation is sampling "
                "noise of the asynchronous runs.")
    return ("Each system's reward curve ends were identical in every round and at every delay: each run is seeded, "
            "TRL's wait changes none of its random draws, and identical curves show that stream-rl's producer, held "
            "at `versions_ahead = 2`, generated every batch on the same weight version whatever the wait: its "
            "rollouts were as many versions old at 3 s as at 0.1 s. The gap in reward gain is therefore not the slow reward's: it is the plain demo's at "
            "this seed (benchmark 9; benchmark 18 measures the plain demo's gain over three seeds). The wait "
            "costs stream-rl time, not reward.")


def _ratio(value: float | None) -> str:
    return "n/a (TRL gained nothing)" if value is None else f"{value:.2f}×"


def headline(result: Mapping[str, Any]) -> str:
    f, g, params = result["figures"], result["gains"], result["params"]
    d = GOAL["delay_s"] if GOAL["delay_s"] in params["delays_s"] else params["delays_s"][-1]
    n = label(d)
    return (f"reward call {d:g} s: stream-rl {f[f'{n}.span_ratio']:.2f}× TRL's time at "
            f"{_ratio(g[f'{n}.gain_ratio'])} its reward gain (goal ≤ {GOAL['span_ratio']}×, ≥ {GOAL['gain_ratio']}×)")


def reading(result: Mapping[str, Any]) -> str:
    f, g, params = result["figures"], result["gains"], result["params"]
    parts = [f"Both systems train the demo ({params['steps']} steps of 256 rollouts, benchmark 9's matched settings) "
             f"with every reward call waiting a fixed time first. TRL calls its reward once per step, between "
             f"generation and the update, so each call's wait adds to every step. stream-rl's scorer, with "
             f"`scorer.batches_in_flight = {params['stream_means']['scorer.batches_in_flight']}` and "
             f"`scorer.reward_concurrency = {params['stream_means']['scorer.reward_concurrency']}`, keeps the calls of "
             f"several batches in flight while the producer generates and the trainer trains; the producer stays at "
             f"most `versions_ahead = 2` versions ahead and the trainer takes rollouts up to `max_lag = 4` versions "
             f"old (the demo's), with the off-policy correction."]
    for d in params["delays_s"]:
        n, st = label(d), params["stages"]
        parts.append(f"**{d:g} s:** TRL {f[f'{n}.trl.span_s']:.1f} s, stream-rl {f[f'{n}.stream.span_s']:.1f} s "
                     f"(**{f[f'{n}.span_ratio']:.2f}×**); reward gain TRL {g[f'{n}.trl.gain']:+.3f}, stream-rl "
                     f"{g[f'{n}.stream.gain']:+.3f} ({_ratio(g[f'{n}.gain_ratio'])}); stream-rl's steps ended "
                     f"{st.get(f'{n}.stream.interval_s', 0.0):.2f} s apart, its trainer waited "
                     f"{st.get(f'{n}.stream.wait_s', 0.0):.2f} s per step for scored rollouts.")
    n = label(GOAL["delay_s"])
    if f"{n}.span_ratio" in f:
        ratio = g[f"{n}.gain_ratio"]
        met = f[f"{n}.span_ratio"] <= GOAL["span_ratio"] and ratio is not None and ratio >= GOAL["gain_ratio"]
        parts.append(f"The issue's goal at {GOAL['delay_s']:g} s (at most {GOAL['span_ratio']}× the time with at "
                     f"least {GOAL['gain_ratio']}× the reward gain) is {'met' if met else 'not met'} in this run.")
    parts.append(_sameness(result))
    parts.append("Run it with `pip install -e '.[trl]'` and `python -m bench.run trlslow` (not part of the default "
                 "run).")
    return " ".join(parts)
