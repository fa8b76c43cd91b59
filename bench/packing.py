"""Benchmark 10, sequence packing: the trainer's tokens/s on padded rows, on packed rows and with shared prompts.

Consumes: a :class:`~bench.common.BenchContext` (size mode; the broker is not used).
Produces: the benchmark result (see :mod:`bench`): per variant the median over interleaved rounds of the
response tokens trained per second by one ``train_step`` (forward, backward, AdamW) of the torch engine on the
same batch; the packed and shared-prompt speed-ups over padded rows; the token slots each layout computes per step
against the real tokens (from :func:`consumers.trainer.packing.pack`); and the first step's gradient norm of each
variant (packing is exact: the norms must agree to float rounding).
Guarantees: the three variants (``padded``: ``share_prompts = false``; ``packed``: ``packing = true``;
``shared``: the default ``share_prompts = true``) train copies of the same initial weights on the same batch, one
step of each per round, round after round (:func:`bench.common.interleave`), so all see the same machine noise;
every figure is a median of at least 3 rounds or a ratio of two such medians. In-process, one torch thread (two
threads on a shared 2-core machine thrash), no Kafka, no timing of batch building.
The policy is the demo's shape (Llama, hidden 128, 4 layers, 4 heads of 32, MLP 512) with random weights built
from a config: throughput only. Response lengths are drawn uniformly from a range (8..64 tokens in the full mode),
the case packing is for: padded rows pay for the longest response of a micro batch on every row.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench.common import BenchContext, fmt, interleave, md_table, medians

VARIANTS = {"padded": {"share_prompts": False}, "packed": {"share_prompts": False, "packing": True},
            "shared": {"share_prompts": True}}
LABELS = {"padded": "padded rows (`share_prompts = false`)", "packed": "packed rows (`packing = true`)",
          "shared": "shared prompts (`share_prompts = true`, the default)"}
VOCAB = 32  # the demo's vocabulary is 19 characters + specials: a small output head, as there


def sizes(ctx: BenchContext) -> dict[str, Any]:
    return {
        "groups": ctx.pick(8, 8, 2),
        "group_size": ctx.pick(8, 8, 4),
        "micro_batch_size": ctx.pick(16, 16, 4),
        "prompt_len": ctx.pick([5, 9], [5, 9], [3, 5]),
        "response_len": ctx.pick([8, 64], [8, 64], [2, 8]),
        "rounds": ctx.pick(max(9, ctx.repeats), 3, 1),
        "threads": 1,
    }


def _policy(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=512, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def _scored(params: dict[str, Any], seed: int = 0) -> list:
    """Groups of random prompts and responses of random lengths (behaviour logprobs -1: timing only)."""
    from schemas import Rollout, ScoredRollout, group_id_for, rollout_id_for

    rng, out = np.random.default_rng(seed), []
    (p_low, p_high), (r_low, r_high) = params["prompt_len"], params["response_len"]
    for g in range(params["groups"]):
        pid, prompt = f"p{g}", rng.integers(3, VOCAB, rng.integers(p_low, p_high + 1)).astype(np.int32)
        for s in range(params["group_size"]):
            n = int(rng.integers(r_low, r_high + 1))
            rollout = Rollout(
                rollout_id=rollout_id_for(pid, 0, s), prompt_id=pid, epoch=0, group_id=group_id_for(pid, 0),
                sample_index=s, group_size=params["group_size"], prompt_token_ids=prompt,
                response_token_ids=rng.integers(3, VOCAB, n).astype(np.int32),
                behavior_logprobs=np.full(n, -1.0, dtype=np.float32), token_policy_versions=np.zeros(n, np.int64),
                finish_reason="length", producer_id="bench-packing", prompt_text="", response_text="",
                temperature=1.0)
            out.append(ScoredRollout(rollout=rollout, reward=float(rng.integers(0, 2)), scorer_id="bench-packing"))
    return out


def _slots(batch, micro_batch_size: int) -> dict[str, int]:
    """Token positions each layout computes per step (micro batch by micro batch) and the real tokens."""
    import torch

    from consumers.trainer.packing import pack

    padded = packed = 0
    for idx in torch.arange(batch.size).split(micro_batch_size):
        sub = batch.select(idx)
        packing = pack(sub.input_ids, sub.attention_mask, sub.position_ids)
        padded, packed = padded + sub.input_ids.numel(), packed + packing.rows * packing.width
    return {"padded_slots": padded, "packed_slots": packed, "real_tokens": int(batch.attention_mask.sum())}


def run(ctx: BenchContext) -> dict[str, Any]:
    import torch

    from consumers.trainer.config import TrainerConfig
    from consumers.trainer.engines import TorchEngine, TrainModule
    from consumers.trainer.tensors import build_batch
    from consumers.trainer.train_step import TrainState, train_step

    params = sizes(ctx)
    batch = build_batch(_scored(params))
    tokens, first_norm = batch.n_tokens, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(params["threads"])

    def variant(name: str):
        cfg = TrainerConfig(micro_batch_size=params["micro_batch_size"], lr=1e-5, **VARIANTS[name])
        module = TrainModule(_policy(), packing=cfg.packing, share_prompts=cfg.share_prompts)
        engine, state = TorchEngine(module, cfg), TrainState()
        first_norm[name] = float(train_step(engine, batch, cfg, state)["optim/grad_norm"])  # untimed, same weights

        def measure() -> dict[str, float]:
            wall, cpu = time.perf_counter(), time.thread_time()
            train_step(engine, batch, cfg, state)
            return {f"{name}_step_s": time.perf_counter() - wall, f"{name}_cpu_s": time.thread_time() - cpu}
        return name, measure

    try:
        steps = [variant(name) for name in VARIANTS]
        samples = interleave(steps, params["rounds"], None, ctx.min_rounds)
    finally:
        torch.set_num_threads(threads)
    med = medians(samples)
    figures = {}
    for unit, tag in (("step_s", ""), ("cpu_s", "_cpu")):  # per second of wall time, per CPU second
        figures.update({f"{n}_tokens{tag}_s": tokens / med[f"{n}_{unit}"] for n in VARIANTS})
        figures.update({f"{n}_vs_padded{tag}": med[f"padded_{unit}"] / med[f"{n}_{unit}"]
                        for n in ("packed", "shared")})
    params.update(_slots(batch, params["micro_batch_size"]), rollouts=batch.size, response_tokens=tokens,
                  first_grad_norm=first_norm,
                  grad_norm_rel_diff=abs(first_norm["packed"] / first_norm["padded"] - 1))
    notes = [f"In-process, one torch thread: {params['groups']} prompts x {params['group_size']} samples per step, "
             f"prompts of {params['prompt_len'][0]}-{params['prompt_len'][1]} tokens, responses of "
             f"{params['response_len'][0]}-{params['response_len'][1]}, micro batches of "
             f"{params['micro_batch_size']}; {params['rounds']} rounds of one timed step of every variant, after one "
             "untimed step each; tokens/s counts response tokens, per second of wall time and per second of the "
             "training thread's CPU time (the machine is shared: CPU time is what other processes do not inflate)."]
    return {"figures": figures, "samples": samples, "params": params, "notes": notes}


# ---------------------------------------------------------------- report


def _ratio(f: dict[str, float], name: str, tag: str = "") -> str:
    return "1×" if name == "padded" else f"**{fmt(f[f'{name}_vs_padded{tag}'])}×**"


def table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    f, p = result["figures"], result["params"]
    slots = {"padded": p["padded_slots"], "packed": p["packed_slots"], "shared": None}
    rows = [[LABELS[n], fmt(f[f"{n}_tokens_s"]), _ratio(f, n), fmt(f[f"{n}_tokens_cpu_s"]), _ratio(f, n, "_cpu"),
             "–" if slots[n] is None else f"{slots[n]:,} ({fmt(100 * p['real_tokens'] / slots[n])} % real)",
             f"{p['first_grad_norm'][n]:.7g}"] for n in VARIANTS]
    return ["trainer forward path", "response tokens/s", "÷ padded", "tokens per CPU second", "÷ padded (CPU)",
            "token slots per step", "first step's gradient norm"], rows


def headline(result: dict[str, Any]) -> str:
    f, p = result["figures"], result["params"]
    return (f"packed rows {fmt(f['packed_vs_padded'])}× the padded trainer's tokens/s "
            f"({fmt(f['packed_vs_padded_cpu'])}× per CPU second), shared prompts {fmt(f['shared_vs_padded'])}× "
            f"(responses {p['response_len'][0]}-{p['response_len'][1]} tokens)")



def more_tables(result: dict[str, Any]) -> str:
    """The batch the table's figures come from, and how close packing's gradient is to the padded one."""
    p = result["params"]
    rows = [["batch", f"{p['rollouts']} rollouts, {p['response_tokens']:,} response tokens"],
            ["response / prompt tokens", f"{p['response_len'][0]}-{p['response_len'][1]} / "
             f"{p['prompt_len'][0]}-{p['prompt_len'][1]} (uniform)"],
            ["token slots, padded ÷ packed", f"{fmt(p['padded_slots'] / p['packed_slots'])}×"],
            ["first step's gradient norm, packed vs padded", f"relative difference {p['grad_norm_rel_diff']:.1e}"]]
    return md_table(["workload", ""], rows)
