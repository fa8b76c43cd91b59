"""Benchmark 19, long tails against TRL: a workload whose response lengths are heavy-tailed (most answers 2-4 tokens,
about one in ten ten times longer), TRL's ``GRPOTrainer`` against ``stream-rl run`` on the same budget
(issue 43, section 3).

Consumes: benchmark 9's two runners (:mod:`bench.trl_peer`: the same demo prompts, matched settings and step rows),
the long-tail policy and reward of :mod:`bench.tail_policy` (built once per invocation from the demo's policy) and
``trl`` (the optional extra ``.[trl]``).
Produces: per round ``r`` (seed ``r`` on both sides; the order reverses every other round) one TRL run and one
``stream-rl run`` per setting of :data:`SETTINGS`, each :data:`STEPS` steps of 256 rollouts with up to
:data:`bench.tail_policy.MAX_NEW_TOKENS` new tokens and the tail reward. Figures (medians over rounds): each
system's span (end of the first step to the end of the last) and ``span_ratio`` (its span / TRL's); in ``gains``
each system's training-reward gain (mean of the last 10 % of steps less the first 10 %) and ``gain_ratio``; in
``params["lengths"]``: the workload's length distribution (:func:`bench.tail_policy.lengths`).
Guarantees: both systems train the same policy on the same prompts with the same reward and cap; TRL with its
matched settings (:data:`bench.trl_worker.MATCHED`), stream-rl with the demo's settings and, in ``packed``, its
documented means for varied lengths (``trainer.packing``); the goal (:data:`GOAL`) is stated met or not.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bench import demo_runs as dr
from bench import tail_policy
from bench import trl_peer as peer
from bench.common import BenchContext
from bench.trl_frontier import met as frontier_met
from bench.trl_frontier import ordered as frontier_ordered
from bench.trl_frontier import ratio_text as _x
from bench.trl_frontier import spans_and_gains

REWARD = (("scorer.reward_fn", tail_policy.TAIL_REWARD),)
SETTINGS: tuple[tuple[str, str, tuple[tuple[str, Any], ...]], ...] = (
    ("demo", "the demo's settings (padded rows with shared prompts)", REWARD),
    ("packed", "`trainer.packing = true` (rows packed end to end; `share_prompts = false`)",
     REWARD + (("trainer.packing", True), ("trainer.share_prompts", False))),
)
STEPS = 60  # a third of the demo's budget: three rounds of three systems in about 18 min
GOAL = {"span_ratio": 0.7, "gain_ratio": 0.95}  # issue 43 §3: at most 0.7x TRL's time at equal reward gain


def workload(ctx: BenchContext, policy, seed: int, sets: tuple[tuple[str, Any], ...] = ()) -> peer.Workload:
    return peer.Workload("tail", tail_policy.MAX_NEW_TOKENS, ctx.pick(full=STEPS, quick=6, tiny=2), False,
                         "the long-tail policy", stream_sets=sets, seed=seed, policy=policy, trl_reward="tail")


def run(ctx: BenchContext) -> dict[str, Any]:
    peer.require_trl("19 (trltail)")
    demo = dr.demo_dir(ctx)
    policy = tail_policy.build(demo, ctx.workdir / "tail-policy", steps=ctx.pick(full=300, quick=100, tiny=5))
    shape = tail_policy.lengths(policy, demo, prompts=ctx.pick(full=256, quick=64, tiny=8))
    names = ["trl"] + [name for name, _, _ in SETTINGS]
    sets = {name: s for name, _, s in SETTINGS}
    samples: dict[str, list[float]] = {}
    stages: dict[str, list[float]] = {}
    for round_no in range(ctx.rounds):
        for name in names if round_no % 2 == 0 else names[::-1]:
            w = workload(ctx, policy, round_no, sets.get(name, ()))
            trace = peer.run_trl(ctx, demo, w) if name == "trl" else peer.run_stream(ctx, demo, w)
            first, last = peer.reward_ends(trace.rewards)
            peer.collect(samples, name, {"span_s": trace.times[-1], "reward_first": first, "reward_last": last,
                                         "gain": last - first})
            peer.collect(stages, name, trace.stages)
            ctx.log(f"  round {round_no + 1}/{ctx.rounds}: {name} done ({trace.times[-1]:.1f} s first to last step)")
    figures, gains = summarise(samples, names)
    steps = workload(ctx, policy, 0).steps
    return {"figures": figures, "gains": gains, "samples": samples,
            "notes": [f"{steps} optimizer steps of 256 rollouts (32 prompts x 8) per run, up to "
                      f"{tail_policy.MAX_NEW_TOKENS} new tokens; seeds {list(range(ctx.rounds))}, one per round."],
            "params": {"steps": steps, "rounds": ctx.rounds, "lengths": shape, "goal": GOAL,
                       "settings": {n: {"what": what, "sets": dict(s)} for n, what, s in SETTINGS},
                       "tail": {"share": tail_policy.TAIL_SHARE, "min": tail_policy.TAIL_MIN,
                                "max": tail_policy.TAIL_MAX},
                       "stages": {k: float(statistics.median(v)) for k, v in stages.items()},
                       "trl_threads": peer.TRL_THREADS, "cores": dr.usable_cores()}}


def summarise(samples: Mapping[str, Sequence[float]], names: Sequence[str]) -> tuple[dict[str, float],
                                                                                   dict[str, float | None]]:
    """``figures``: each system's median span and ``span_ratio`` against TRL's; ``gains``: each system's median
    gain, first and last reward, and ``gain_ratio`` (None when TRL gained nothing)."""
    return spans_and_gains(samples, names)


def met(result: Mapping[str, Any], name: str) -> bool:
    return frontier_met(result, name, GOAL)


def ordered(result: Mapping[str, Any]) -> list[str]:
    return frontier_ordered(result, SETTINGS)


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    f, g, settings = result["figures"], result["gains"], result["params"]["settings"]
    header = ["system", "span (s)", "time / TRL", "train reward first → last", "gain", "gain / TRL",
              f"goal (≤ {GOAL['span_ratio']}× time, ≥ {GOAL['gain_ratio']}× gain)"]
    rows = []
    for n in ["trl", *ordered(result)]:
        trl = n == "trl"
        rows.append(["TRL GRPOTrainer" if trl else f"stream-rl `{n}`: {settings[n]['what']}",
                     f"{f[f'{n}.span_s']:.1f}", "–" if trl else f"**{f[f'{n}.span_ratio']:.2f}×**",
                     f"{g[f'{n}.reward_first']:.3f} → {g[f'{n}.reward_last']:.3f}", f"{g[f'{n}.gain']:+.3f}",
                     "–" if trl else _x(g[f"{n}.gain_ratio"]), "–" if trl else ("met" if met(result, n) else "not met")])
    return header, rows


def headline(result: Mapping[str, Any]) -> str:
    f, g, settings = result["figures"], result["gains"], ordered(result)
    parts = [f"`{n}` {f[f'{n}.span_ratio']:.2f}× TRL's time at {_x(g[f'{n}.gain_ratio'])} its gain" for n in settings]
    return "; ".join(parts) + f" (goal ≤ {GOAL['span_ratio']}×, ≥ {GOAL['gain_ratio']}×)"


def reading(result: Mapping[str, Any]) -> str:
    f, g, params = result["figures"], result["gains"], result["params"]
    shape, tail, st = params["lengths"], params["tail"], params["stages"]
    parts = [f"The workload: the demo's policy fine-tuned on its own sampled answers, {tail['share']:.0%} of them "
             f"followed by {tail['min']}-{tail['max']} `=` before `<eos>` (`bench/tail_policy.py`), scored by the "
             f"demo's verifier on the answer without its trailing `=` run, so the tail costs tokens and no reward. "
             f"Sampled at temperature 1 its responses were {shape['mean']:.1f} tokens on average (median "
             f"{shape['p50']:.0f}, p90 {shape['p90']:.0f}, p99 {shape['p99']:.0f}, longest {shape['max']:.0f}); "
             f"{shape['long_share']:.1%} were over 10 tokens, and its accuracy was {shape['accuracy']:.3f}. With 256 "
             f"rollouts per step nearly every batch holds a long one, so a batch that waits for its longest row "
             f"generates to the tail every step."]
    for n in ["trl", *ordered(result)]:
        parts.append(f"**{n}**: {f[f'{n}.span_s']:.1f} s first to last step ({params['steps']} steps), reward "
                     f"{g[f'{n}.reward_first']:.3f} → {g[f'{n}.reward_last']:.3f}"
                     + ("" if n == "trl" else f", {f[f'{n}.span_ratio']:.2f}× TRL's time at "
                        f"{_x(g[f'{n}.gain_ratio'])} its gain")
                     + (f"; TRL generated for {st.get('trl.generate_s', 0.0):.2f} s and trained for "
                        f"{st.get('trl.fwd_bwd_s', 0.0):.2f} s per step, one after the other" if n == "trl" else
                        f"; its producer generated a batch in {st.get(f'{n}.generate_s', 0.0):.2f} s while its "
                        f"trainer worked {st.get(f'{n}.step_s', 0.0):.2f} s per step (update "
                        f"{st.get(f'{n}.update_s', 0.0):.2f} s) and waited {st.get(f'{n}.wait_s', 0.0):.2f} s")
                     + ".")
    hit = [n for n in ordered(result) if met(result, n)]
    parts.append(f"The issue's goal (at most {GOAL['span_ratio']}× TRL's time at equal reward gain, taken as at "
                 f"least {GOAL['gain_ratio']}× it) is " + (f"met by {', '.join(hit)}." if hit else
                                                          "met by no setting in this run."))
    parts.append("Run it with `pip install -e '.[trl]'` and `python -m bench.run trltail` (not part of the default "
                 "run).")
    return " ".join(parts)
