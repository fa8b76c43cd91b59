"""Benchmark: no batch barrier (issue 31, item 3): a group's publication delay and the trainer's wait per step,
with the batch barrier (``producer.stream_groups = false``) and without it (the default), side by side.

Consumes: a :class:`~bench.common.BenchContext` (size mode; the broker is not used).
Produces: the benchmark result (see :mod:`bench`): per mode, the median over rounds of (1) the median over groups
of the time from a group's last token to its publication, and (2) the mean trainer wait per step; the measured
trainer step time those waits use; every per-round sample.
Guarantees:
- The real generation step (:func:`producers.step.produce_rollouts`) on the real hf engine, the demo's model
  shape with random weights and the demo's character tokenizer: response lengths are long and varied (each token
  ends a sample with probability about 1 / vocabulary, up to ``max_new_tokens``), the long-tail case.
- Both modes draw the same samples (same prompts and seed per round; the hand-over changes no token, tested in
  tests/integration/test_long_tail.py), one round of each after the other (:func:`bench.common.interleave`), so
  they differ only in when a group is published. Publishing a group = encoding its rollouts for the wire
  (``schemas.encode``), in the generation's own thread: with the barrier after the batch returns, without it
  from inside the decode loop.
- A group's last token is timed by a forward hook on the model: token j is drawn right after forward j + 1
  (prefill included) returns.
- Trainer wait per step: a trainer that takes ``groups_per_step`` published groups per step and trains each step
  for ``train_s`` (a real ``train_step`` of that many of these groups, median of 3, measured up front) is replayed
  over each round's measured publication times (:func:`trainer_waits`); no Kafka, in-process, one torch thread.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.common import BenchContext, fmt, interleave, md_table, medians

MODES = ("barrier", "stream", "oversample")
LABELS = {"barrier": "batch barrier (`producer.stream_groups = false`)",
          "stream": "groups streamed (`producer.stream_groups = true`, the default)",
          "oversample": "streamed, `producer.oversample = 0.5` (tail re-queued)"}
OVERSAMPLE = 0.5


def sizes(ctx: BenchContext) -> dict[str, Any]:
    return {
        "prompts": ctx.pick(16, 8, 4),
        "group_size": ctx.pick(4, 4, 2),
        "max_new_tokens": ctx.pick(128, 64, 12),
        "groups_per_step": ctx.pick(4, 4, 2),
        "rounds": ctx.pick(max(3, ctx.repeats), 3, 1),
        "threads": 1,
    }


def trainer_waits(published: list[float], groups_per_step: int, train_s: float) -> list[float]:
    """Waits of a trainer that needs ``groups_per_step`` groups per step, from t = 0 on::

        ready_i = published_sorted[(i + 1) * k - 1]      (the step's k-th group is out)
        wait_i  = max(0, ready_i - t_i),   t_{i+1} = max(t_i, ready_i) + train_s,   t_0 = 0

    for the ``len(published) // k`` whole steps (times in seconds since the batch started)."""
    times, k = sorted(published), groups_per_step
    waits, t = [], 0.0
    for i in range(len(times) // k):
        ready = times[(i + 1) * k - 1]
        waits.append(max(0.0, ready - t))
        t = max(t, ready) + train_s
    return waits


def _engine():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from producers.engines.hf import HFEngine
    from stream_rl.demo.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=512, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return HFEngine(LlamaForCausalLM(config), tokenizer)


def _prompts(params: dict[str, Any]) -> list:
    from schemas import Prompt

    return [Prompt(prompt_id=f"p{i}", epoch=0, text=f"{i + 10}+{i * 7 % 90}=", answer="0",
                   group_size=params["group_size"], created_at=time.time()) for i in range(params["prompts"])]


def _round(engine, params: dict[str, Any], mode: str, seed: int) -> dict[str, Any]:
    """One generation of the batch in ``mode``: per group its last-token and publication times (s since start)."""
    from producers.engines.base import Sampling
    from producers.step import EarlyStop, produce_rollouts
    from schemas import encode

    stamps: list[float] = []  # end of every forward: [prefill, decode step 1, ...]
    published: dict[str, float] = {}

    def publish(rollouts) -> None:
        for rollout in rollouts:
            encode(rollout)
        published[rollouts[0].group_id] = time.perf_counter()

    hook = engine.model.register_forward_hook(lambda *_: stamps.append(time.perf_counter()))
    start = time.perf_counter()
    try:
        result = produce_rollouts(_prompts(params), engine, producer_id="bench", sampling=Sampling(temperature=1.0),
                                  max_new_tokens=params["max_new_tokens"], seed=seed,
                                  on_group=None if mode == "barrier" else publish,
                                  early_stop=EarlyStop(OVERSAMPLE) if mode == "oversample" else None)
        if mode == "barrier":
            groups: dict[str, list] = {}
            for r in result.rollouts:
                groups.setdefault(r.group_id, []).append(r)
            for rollouts in groups.values():
                publish(rollouts)
    finally:
        hook.remove()
    longest: dict[str, int] = {}
    for r in result.rollouts:
        longest[r.group_id] = max(longest.get(r.group_id, 0), r.response_length)
    last_token = {g: stamps[n - 1] - start for g, n in longest.items()}  # token n-1 follows forward n
    return {"last_token": last_token, "published": {g: t - start for g, t in published.items()},
            "lengths": [r.response_length for r in result.rollouts], "aborted": len(result.aborted)}


def _train_s(engine, params: dict[str, Any], rounds: int) -> float:
    """Median wall time of a real ``train_step`` on ``groups_per_step`` of this batch's groups (torch engine)."""
    import copy

    from consumers.trainer.config import TrainerConfig
    from consumers.trainer.engines import TorchEngine, TrainModule
    from consumers.trainer.tensors import build_batch
    from consumers.trainer.train_step import TrainState, train_step
    from producers.engines.base import Sampling
    from producers.step import produce_rollouts
    from schemas import ScoredRollout

    k = params["groups_per_step"]
    result = produce_rollouts(_prompts(params)[:k], engine, producer_id="bench", sampling=Sampling(temperature=1.0),
                              max_new_tokens=params["max_new_tokens"], seed=10_000)
    scored = [ScoredRollout(rollout=r, reward=float(i % 2), scorer_id="bench") for i, r in enumerate(result.rollouts)]
    cfg = TrainerConfig(groups_per_step=k, micro_batch_size=64, lr=1e-5)
    policy = copy.deepcopy(engine.model).train(False)
    for param in policy.parameters():  # the engine froze its copy
        param.requires_grad_(True)
    trainer = TorchEngine(TrainModule(policy), cfg)
    batch, state, times = build_batch(scored, engine.tokenizer.pad_token_id), TrainState(), []
    for _ in range(max(rounds, 3)):
        t0 = time.perf_counter()
        train_step(trainer, batch, cfg, state)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(ctx: BenchContext) -> dict[str, Any]:
    import torch

    params = sizes(ctx)
    threads = torch.get_num_threads()
    torch.set_num_threads(params["threads"])
    rounds_done = {m: 0 for m in MODES}
    lengths: list[int] = []
    try:
        engine = _engine()
        train_s = _train_s(engine, params, params["rounds"])

        def step(mode: str):
            def measure() -> dict[str, float]:
                out = _round(engine, params, mode, seed=rounds_done[mode])
                rounds_done[mode] += 1
                if mode == "barrier":
                    lengths.extend(out["lengths"])
                delays = [out["published"][g] - t for g, t in out["last_token"].items()]
                waits = trainer_waits(list(out["published"].values()), params["groups_per_step"], train_s)
                return {f"{mode}_publish_delay_s": statistics.median(delays),
                        f"{mode}_trainer_wait_s": statistics.fmean(waits),
                        f"{mode}_first_wait_s": waits[0], f"{mode}_batch_s": max(out["published"].values()),
                        **({"oversample_aborted_groups": out["aborted"]} if mode == "oversample" else {})}
            return mode, measure

        samples = interleave([step(m) for m in MODES], params["rounds"], ctx.log, ctx.min_rounds)
    finally:
        torch.set_num_threads(threads)
    med = medians(samples)
    figures = {**{k: v for k, v in med.items() if k != "oversample_aborted_groups"}, "train_step_s": train_s,
               "publish_delay_ratio": med["barrier_publish_delay_s"] / med["stream_publish_delay_s"],
               "trainer_wait_ratio": med["barrier_trainer_wait_s"] / med["stream_trainer_wait_s"]}
    params.update(oversample=OVERSAMPLE, aborted_groups_per_batch=med["oversample_aborted_groups"],
                  response_lengths={"min": min(lengths), "median": statistics.median(lengths),
                                    "max": max(lengths), "mean": statistics.fmean(lengths)})
    notes = [f"In-process, one torch thread: {params['prompts']} prompts x {params['group_size']} samples per batch "
             f"(one `produce_rollouts` call), up to {params['max_new_tokens']} new tokens, temperature 1, the demo's "
             f"model shape with random weights; a trainer of {params['groups_per_step']} groups per step taking "
             f"{fmt(train_s)} s per step (measured) replayed over the publication times; {params['rounds']} rounds "
             "of each mode, interleaved, medians."]
    return {"figures": figures, "samples": samples, "params": params, "notes": notes}


# ---------------------------------------------------------------- report


def table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    f = result["figures"]
    rows = [[LABELS[m], fmt(f[f"{m}_publish_delay_s"]), fmt(f[f"{m}_first_wait_s"]), fmt(f[f"{m}_trainer_wait_s"]),
             fmt(f[f"{m}_batch_s"])] for m in MODES]
    return ["producer mode", "last token -> publication, s (median group)", "trainer's first wait, s",
            "trainer wait per step, s (mean)", "batch generation, s"], rows


def headline(result: dict[str, Any]) -> str:
    f = result["figures"]
    return (f"streamed groups are published {fmt(f['publish_delay_ratio'])}× sooner after their last token and the "
            f"trainer waits {fmt(f['trainer_wait_ratio'])}× less per step than with the batch barrier")



def more_tables(result: dict[str, Any]) -> str:
    """The workload the table's figures come from."""
    f, p = result["figures"], result["params"]
    lengths = p["response_lengths"]
    rows = [["batch", f"{p['prompts']} prompts x {p['group_size']} samples"],
            ["response tokens", f"{lengths['min']}-{lengths['max']} (median {fmt(lengths['median'])})"],
            ["trainer (replayed)", f"{p['groups_per_step']} groups per step, {fmt(f['train_step_s'])} s per step"],
            ["`producer.oversample`", f"{p['oversample']}: stops at ceil(B / {1 + p['oversample']}) complete groups, "
             f"a median {fmt(p['aborted_groups_per_batch'])} groups of {p['prompts']} cut per batch and re-queued"]]
    return md_table(["workload", ""], rows)

if __name__ == "__main__":
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        out = run(BenchContext(bootstrap="unused", mode="full", workdir=Path(tmp)))
    print(json.dumps({"figures": out["figures"], "params": out["params"]}, indent=2))
    print(headline(out))
