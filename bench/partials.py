"""Benchmark: durable partial rollouts (issue 41.2): the share of a long-tail workload's generated tokens that
resumption keeps, against re-queuing the cut groups and regenerating them from scratch.

Consumes: a :class:`~bench.common.BenchContext` (size mode; the broker is not used).
Produces: the benchmark result (see :mod:`bench`): per round, for the groups ``producer.oversample`` cut, the tokens
their prefixes held (generated before the cut), the tokens generated to complete them by resumption and by
regeneration from scratch, and the wall time of each completion; medians over rounds; every per-round sample.
Guarantees:
- The product's code path: the batch is one :func:`producers.step.produce_rollouts` call with
  ``EarlyStop(oversample, keep_partials=True)`` on the real hf engine (what the producer runs with
  ``producer.partial_max_lag``); its partial groups go through the wire codec (``schemas.encode`` / ``decode``, as
  on the partials topic) and are completed by :func:`producers.partials.resume_partials`; the other arm completes
  the same cut prompts as a re-queue does: ``produce_rollouts`` with ``attempt + 1`` and no early stop.
- The long-tail workload of benchmark 13 (:mod:`bench.long_tail`): the demo's model shape with random weights and
  the demo's character tokenizer, temperature 1: response lengths are long and varied (each token ends a sample
  with probability about 1 / vocabulary, up to ``max_new_tokens``).
- Both arms complete the same cut groups on the same weights (v0: no new version arrives here, so no prefix is
  stale), one after the other, in alternating order per round; one torch thread.
- Token counts are response tokens of samples (a padded row of the decode loop is not a token); ``kept share`` =
  prefix tokens / tokens of the completed cut groups.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from bench.common import BenchContext, fmt, md_table
from bench.long_tail import _engine, _prompts

OVERSAMPLE = 0.5


def sizes(ctx: BenchContext) -> dict[str, Any]:
    return {
        "prompts": ctx.pick(16, 8, 4),
        "group_size": ctx.pick(4, 4, 2),
        "max_new_tokens": ctx.pick(128, 64, 12),
        "rounds": ctx.pick(max(3, ctx.repeats), 3, 1),
        "threads": 1,
    }


def _round(engine, params: dict[str, Any], seed: int) -> dict[str, float] | None:
    """One cut batch, its cut groups completed both ways; None when nothing was cut."""
    from producers.engines.base import Sampling
    from producers.step import EarlyStop, produce_rollouts
    from producers.partials import resume_partials
    from schemas import decode, encode

    sampling, budget = Sampling(temperature=1.0), params["max_new_tokens"]
    prompts = [dataclasses.replace(p, prompt_id=f"r{seed}-{p.prompt_id}") for p in _prompts(params)]
    t0 = time.perf_counter()
    batch = produce_rollouts(prompts, engine, producer_id="bench", sampling=sampling, max_new_tokens=budget,
                             seed=seed, early_stop=EarlyStop(OVERSAMPLE, keep_partials=True))
    batch_s = time.perf_counter() - t0
    if not batch.partials:
        return None
    partials = [decode(encode(p)) for p in batch.partials]  # as read back from the partials topic
    cut = [dataclasses.replace(prompts[i], attempt=prompts[i].attempt + 1) for i in batch.aborted]

    def resume() -> tuple[float, int]:
        t = time.perf_counter()
        out = resume_partials(partials, engine, producer_id="bench", sampling=sampling, max_new_tokens=budget,
                              max_lag=0, seed=seed)
        return time.perf_counter() - t, int(out.metrics["producer/partials_new_tokens"])

    def regenerate() -> tuple[float, int]:
        t = time.perf_counter()
        out = produce_rollouts(cut, engine, producer_id="bench", sampling=sampling, max_new_tokens=budget, seed=seed)
        return time.perf_counter() - t, sum(r.response_length for r in out.rollouts)

    first, second = (resume, regenerate) if seed % 2 == 0 else (regenerate, resume)
    timed = {first: first(), second: second()}
    (resume_s, resumed_new), (regen_s, regen_tokens) = timed[resume], timed[regenerate]
    kept = sum(int(p.sample_lengths.sum()) for p in partials)
    complete = sum(r.response_length for r in batch.rollouts)
    return {"cut_groups": len(partials), "batch_groups": len(prompts), "prefix_tokens": kept,
            "resume_new_tokens": resumed_new, "regenerate_tokens": regen_tokens, "complete_group_tokens": complete,
            "kept_share": kept / (kept + resumed_new),
            "batch_tokens_wasted_by_regeneration": kept / (kept + complete),
            "tokens_per_batch_resume": complete + kept + resumed_new,
            "tokens_per_batch_regenerate": complete + kept + regen_tokens,
            "resume_s": resume_s, "regenerate_s": regen_s, "batch_s": batch_s}


def collect_rounds(engine, params: dict[str, Any], ctx: BenchContext, max_seed: int | None = None,
                   skipped: str = "nothing cut") -> dict[str, list[float]]:
    """Every figure of :func:`_round` per round, seed 0, 1, ... until ``params["rounds"]`` batches cut something
    (a batch that cut nothing is skipped and logged with ``skipped``); at most ``max_seed`` seeds when given."""
    samples: dict[str, list[float]] = {}
    seed = 0
    while len(samples.get("kept_share", [])) < params["rounds"] and (max_seed is None or seed < max_seed):
        out = _round(engine, params, seed)
        seed += 1
        if out is None:
            ctx.log(f"  seed {seed - 1}: {skipped}, next seed")
            continue
        for name, value in out.items():
            samples.setdefault(name, []).append(float(value))
        ctx.log(f"  round {len(samples['kept_share'])}/{params['rounds']}: kept share {out['kept_share']:.3f}")
    return samples


def summary(samples: dict[str, list[float]], params: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The benchmark result of the rounds' ``samples``: medians, the figures, the batch-level params, ``notes``."""
    med = {name: float(statistics.median(values)) for name, values in samples.items()}
    figures = {"kept_share": med["kept_share"], "prefix_tokens": med["prefix_tokens"],
               "resume_new_tokens": med["resume_new_tokens"], "regenerate_tokens": med["regenerate_tokens"],
               "batch_tokens_wasted_by_regeneration": med["batch_tokens_wasted_by_regeneration"],
               "resume_s": med["resume_s"], "regenerate_s": med["regenerate_s"],
               "completion_speedup": med["regenerate_s"] / med["resume_s"]}
    params.update(oversample=OVERSAMPLE, cut_groups_per_batch=med["cut_groups"],  # may be <= 0: not a figure
                  tokens_saved_share=1 - med["tokens_per_batch_resume"] / med["tokens_per_batch_regenerate"])
    return {"figures": figures, "samples": samples, "params": params, "notes": notes}


def run(ctx: BenchContext) -> dict[str, Any]:
    import torch

    params = sizes(ctx)
    threads = torch.get_num_threads()
    torch.set_num_threads(params["threads"])
    try:
        samples = collect_rounds(_engine(), params, ctx)
    finally:
        torch.set_num_threads(threads)
    notes = [f"In-process, one torch thread: {params['prompts']} prompts x {params['group_size']} samples per batch, "
             f"up to {params['max_new_tokens']} new tokens, temperature 1, the demo's model shape with random "
             f"weights, `producer.oversample = {OVERSAMPLE}`; {params['rounds']} rounds (a batch that cut nothing is "
             "skipped), medians. The resumed and the regenerated completions are different samples of the same "
             "policy (the same weights): their token counts differ by chance as well as by the prefix kept."]
    return summary(samples, params, notes)


# ---------------------------------------------------------------- report


def table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    f = result["figures"]
    rows = [["resumed from the durable prefixes (`producer.partial_max_lag`)", fmt(f["prefix_tokens"]),
             fmt(f["resume_new_tokens"]), fmt(f["resume_s"])],
            ["re-queued and regenerated from scratch", "0 (discarded)", fmt(f["regenerate_tokens"]),
             fmt(f["regenerate_s"])]]
    return ["cut groups completed by", "prefix tokens kept", "tokens generated to complete them",
            "completion time, s"], rows


def more_tables(result: dict[str, Any]) -> str:
    f, p = result["figures"], result["params"]
    rows = [["share of the cut groups' final tokens kept from their prefixes", fmt(f["kept_share"])],
            ["share of the batch's generated tokens regeneration throws away",
             fmt(f["batch_tokens_wasted_by_regeneration"])],
            ["tokens generated per batch, saved by resumption", fmt(p["tokens_saved_share"])],
            ["cut groups per batch", f"{fmt(p['cut_groups_per_batch'])} of {p['prompts']}"]]
    return md_table(["figure (medians)", ""], rows)


def headline(result: dict[str, Any]) -> str:
    f = result["figures"]
    return (f"resumption keeps {fmt(100 * f['kept_share'])} % of the cut groups' tokens from their prefixes; "
            f"{fmt(100 * f['batch_tokens_wasted_by_regeneration'])} % of a batch's generated tokens are thrown away "
            f"by regeneration from scratch")


def reading(result: dict[str, Any]) -> str:
    f = result["figures"]
    return (f"In this long-tail workload the groups `producer.oversample` cuts had generated "
            f"{fmt(f['prefix_tokens'])} tokens (median per batch) when the batch stopped. Re-queuing them throws "
            f"those away ({fmt(100 * f['batch_tokens_wasted_by_regeneration'])} % of the batch's tokens) and "
            f"generates {fmt(f['regenerate_tokens'])} tokens again; resuming them from the partials topic generates "
            f"{fmt(f['resume_new_tokens'])}, so {fmt(100 * f['kept_share'])} % of their final tokens are the kept "
            f"prefixes and completing them takes {fmt(f['completion_speedup'])}x less time. Regeneration also "
            f"draws fresh samples for exactly the groups that were long: they come back shorter on average, which "
            f"biases a re-queuing producer against long responses; resumption keeps the samples it started.")


if __name__ == "__main__":
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        out = run(BenchContext(bootstrap="unused", mode="quick", workdir=Path(tmp)))
    print(json.dumps({"figures": out["figures"], "params": out["params"]}, indent=2))
    print(headline(out))
