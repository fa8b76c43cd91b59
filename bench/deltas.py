"""Benchmark 8, delta versions: the bytes one weight version costs per RL step when it may ship as a delta against
the version before it (``weights.snapshot_every`` > 1), against the full payload, on real training steps.

What each step measures, per broadcast dtype, with the publisher's own functions (no Kafka, no files)::

    state_k = cast_floating(engine.policy_state_dict(), dtype)     after optimizer step k, as the trainer casts it
    flat_k  = flat_payload(prepare(state_k), index)                index = serialize(state_0).tensors, computed once
    changed = changed_fraction(xor(flat_k, flat_(k-1)))            and the fraction of elements whose bits changed
    t0 ─ encode_delta(flat_k, flat_(k-1)) ─ t1 ─ apply_delta(k, flat_(k-1), delta) ─ t2   then rebuilt == flat_k
    sent    = len(delta) if a delta is made and len(delta) <= MAX_DELTA_RATIO * len(flat_k), else len(flat_k)

``sent`` is what ``WeightsPublisher._delta_of`` decides. The full size is the payload (the safetensors data
section; its header of a few kB is left out). The encode time includes the XOR and count that decide.

- ``demo``: the built-in demo policy trained by :class:`bench.inproc.DemoLoop` (real generation, verifier scoring
  and ``train_step`` with the demo's trainer config, lr 1e-4, lag 0), broadcast as float32 (the demo's
  ``producer.dtype``) and as bfloat16 (what a bf16 producer would receive).
- ``qwen``: a ``Qwen2ForCausalLM`` with Qwen2.5-0.5B's shape (494 M parameters, tied embeddings), random init
  (seed 0, no downloaded weights), fp32 master weights in the trainer's torch engine with bf16 autocast, AdamW at
  lr 1e-6, trained by ``train_step`` on synthetic scored rollouts (2 groups of 4, 16 prompt + 16 response tokens of
  random ids, behaviour logprobs from the model itself, uniform random rewards); broadcast as bfloat16. Skipped
  with a note when the RAM would not hold it; the tiny mode uses a 2-layer model of the same family.

Figures: per workload and dtype, medians over steps 2..N; step 1 is reported apart (AdamW's first update has no
history: it moves every element with a gradient by exactly lr).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bench.common import MB, BenchContext, fmt, md_table, mem_available_bytes
from stream_rl.weights.delta import MAX_CHANGED_FRACTION, apply_delta, changed_fraction, encode_delta, flat_payload, xor
from stream_rl.weights.publisher import MAX_DELTA_RATIO

TITLE = "Delta versions"
GOAL = 0.05
"""Issue 14's goal: a version costs at most this fraction of the full bytes per step."""
QWEN_SHAPE = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True}
"""Qwen2.5-0.5B's architecture (its config.json), built with random weights."""
QWEN_TINY = {**QWEN_SHAPE, "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4}
QWEN_LR = 1e-6
"""A typical RL fine-tuning learning rate at this size."""
QWEN_BYTES_PER_PARAM = 28
"""Rough peak RAM per parameter: fp32 weights, gradients, AdamW m and v (16), the fp32 state-dict copy the trainer
casts from (4), and about four bf16 payloads (the previous, the new, the XOR and the rebuilt: 8)."""
LABELS = {"demo": "demo policy", "qwen": "Qwen2.5-0.5B shape, random init"}


def sizes(ctx: BenchContext) -> dict[str, Any]:
    return {"demo_steps": ctx.pick(12, 4, 2), "demo_prompts": ctx.pick(32, 16, 4), "demo_group": ctx.pick(8, 8, 4),
            "qwen_steps": ctx.pick(4, 2, 2), "qwen_config": ctx.pick(QWEN_SHAPE, QWEN_SHAPE, QWEN_TINY),
            "qwen_lr": QWEN_LR, "qwen_groups": 2, "qwen_group_size": 4, "prompt_tokens": 16, "response_tokens": 16}


# ---------------------------------------------------------------- one step


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """One version against the one before it."""

    step: int
    full_bytes: int
    changed: float  # fraction of the payload's bytes that differ
    changed_elements: float  # fraction of the tensors' elements whose bits differ
    delta_bytes: int | None  # None: encode_delta made no delta
    sent_bytes: int  # what the publisher sends
    encode_s: float
    rebuild_s: float | None


def changed_elements(diff: np.ndarray, index: Sequence[Any]) -> float:
    """Fraction of the elements of ``index``'s tensors with at least one non-zero byte in ``diff`` (``uint8 [n]``)."""
    changed = total = 0
    for entry in index:
        numel = math.prod(entry.shape)
        if numel:
            elements = diff[entry.offset:entry.end].reshape(numel, entry.nbytes // numel)  # [numel, itemsize]
            changed, total = changed + int(np.count_nonzero(elements.any(axis=1))), total + numel
    return changed / total if total else 0.0


def measure_step(step: int, new: np.ndarray, prev: np.ndarray, index: Sequence[Any]) -> StepBytes:
    """Encode ``new`` against ``prev``, rebuild it, check the rebuild bit for bit (RuntimeError otherwise)."""
    diff = xor(new, prev)
    changed, elements = changed_fraction(diff), changed_elements(diff, index)
    del diff
    t0 = time.perf_counter()
    blob = encode_delta(new, prev)
    encode_s = time.perf_counter() - t0
    rebuild_s = None
    if blob is not None:
        t1 = time.perf_counter()
        rebuilt = apply_delta(step, prev, blob)
        rebuild_s = time.perf_counter() - t1
        if not np.array_equal(rebuilt, new):
            raise RuntimeError(f"step {step}: the payload rebuilt from the delta is not the version's payload")
    usable = blob is not None and len(blob) <= MAX_DELTA_RATIO * new.size
    return StepBytes(step, new.size, changed, elements, None if blob is None else len(blob),
                     len(blob) if usable else new.size, encode_s, rebuild_s)


class DeltaMeter:
    """The previous version's payload per broadcast dtype; :meth:`add` measures the step to the next version."""

    def __init__(self, dtypes: Sequence[str]):
        self.dtypes = tuple(dtypes)
        self.index: dict[str, tuple] = {}
        self.prev: dict[str, np.ndarray] = {}
        self.steps: dict[str, list[StepBytes]] = {d: [] for d in self.dtypes}

    def add(self, state: Mapping[str, Any], step: int) -> None:
        """``state``: the engine's fp32 policy state after ``step`` optimizer steps (0: the initial weights)."""
        from consumers.trainer.engines import cast_floating
        from stream_rl.weights.payload import prepare, serialize

        for dtype in self.dtypes:
            tensors = prepare(cast_floating(dict(state), dtype))
            if dtype not in self.index:  # the publisher's base index: that of its first full snapshot
                self.index[dtype] = serialize(tensors).tensors
            flat = flat_payload(tensors, self.index[dtype])
            del tensors
            if dtype in self.prev:
                self.steps[dtype].append(measure_step(step, flat, self.prev[dtype], self.index[dtype]))
            self.prev[dtype] = flat


def weight_scale(state: Mapping[str, Any], sample: int = 1 << 20) -> float:
    """Median |w| of the floating-point weights (over an even sample of at most ``sample`` elements)."""
    import torch

    flat = torch.cat([t.detach().reshape(-1).float() for t in state.values() if t.is_floating_point()])
    stride = max(1, flat.numel() // sample)
    return float(flat[::stride].abs().median())


# ---------------------------------------------------------------- workloads


def demo_workload(ctx: BenchContext, params: dict[str, Any], meter: DeltaMeter) -> dict[str, Any]:
    """Real RL steps of the demo (:class:`bench.inproc.DemoLoop`), each version handed to ``meter``."""
    import torch

    from bench.demo_runs import demo_config, demo_dir
    from bench.inproc import DemoLoop, LoopSpec

    demo = demo_dir(ctx)
    tcfg = demo_config(ctx, demo, "deltas").trainer
    spec = LoopSpec(steps=params["demo_steps"], prompts_per_step=params["demo_prompts"],
                    group_size=params["demo_group"], lag=0, variant="decoupled", seed=0, eval_prompts=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a ~1 M-parameter model: a second thread on a shared 2-core machine only thrashes
    try:
        loop = DemoLoop(demo, tcfg, spec)
        first = loop.engine.policy_state_dict()
        info = {"lr": tcfg.lr, "parameters": sum(t.numel() for t in first.values()),
                "weight_scale": weight_scale(first), "rewards": []}
        meter.add(first, 0)
        for step in range(1, spec.steps + 1):
            reward, _ = loop.train_one()
            info["rewards"].append(reward)
            meter.add(loop.engine.policy_state_dict(), step)
            ctx.log(f"  demo step {step}: reward {reward:.3f}")
    finally:
        torch.set_num_threads(threads)
    return info


def _rollout(prompt_ids, response_ids, logp, group: int, sample: int, version: int, step: int):
    from schemas import Rollout, group_id_for, rollout_id_for

    prompt_id = f"synthetic-{step}-{group}"  # response_ids [group_size, T], logp [T]
    return Rollout(
        rollout_id=rollout_id_for(prompt_id, 0, sample), prompt_id=prompt_id, epoch=0,
        group_id=group_id_for(prompt_id, 0), sample_index=sample, group_size=response_ids.shape[0],
        prompt_token_ids=prompt_ids, response_token_ids=response_ids[sample],
        behavior_logprobs=np.minimum(logp, 0.0).astype(np.float32),
        token_policy_versions=np.full(len(logp), version, dtype=np.int64), finish_reason="length",
        producer_id="bench-deltas", prompt_text="synthetic", response_text="synthetic", temperature=1.0)


def synthetic_scored(engine, params: dict[str, Any], vocab: int, step: int, version: int) -> list:
    """Valid scored rollouts of random tokens whose behaviour logprobs are the current model's (lag 0), with uniform
    random rewards (so GRPO's advantages are non-zero)."""
    from consumers.trainer.forward import proximal_pass
    from consumers.trainer.tensors import build_batch
    from schemas import ScoredRollout, validate

    rng, size = np.random.default_rng(step), params["qwen_group_size"]
    groups = [(rng.integers(0, vocab, params["prompt_tokens"], dtype=np.int32),
               rng.integers(0, vocab, (size, params["response_tokens"]), dtype=np.int32))
              for _ in range(params["qwen_groups"])]

    def rollouts(logp):  # logp [B, T]: row b is group b // size, sample b % size
        return [_rollout(p, r, logp[g * size + s], g, s, version, step)
                for g, (p, r) in enumerate(groups) for s in range(size)]

    placeholder = np.full((len(groups) * size, params["response_tokens"]), -1.0, dtype=np.float32)  # [B, T]
    batch = build_batch([ScoredRollout(rollout=r, reward=0.0, scorer_id="bench-deltas") for r in rollouts(placeholder)])
    logp = proximal_pass(engine, batch, batch.size).logp.cpu().numpy()  # [B, T]
    return [validate(ScoredRollout(rollout=r, reward=float(rng.random()), scorer_id="bench-deltas"))
            for r in rollouts(logp)]


def qwen_model(config_kwargs: Mapping[str, Any], device: str = "cpu"):
    """A randomly initialised ``Qwen2ForCausalLM`` (seed 0); on ``meta``: no memory, no time (to count)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(Qwen2Config(**config_kwargs))


def qwen_workload(ctx: BenchContext, params: dict[str, Any], meter: DeltaMeter,
                  notes: list[str]) -> dict[str, Any] | None:
    """``train_step`` on synthetic rollouts with a Qwen2 model, each version handed to ``meter``; None (and a note)
    when the RAM would not hold it."""
    from consumers.trainer.config import TrainerConfig
    from consumers.trainer.engines import TrainModule, build_engine
    from consumers.trainer.tensors import build_batch
    from consumers.trainer.train_step import TrainState, train_step

    count = sum(p.numel() for p in qwen_model(params["qwen_config"], "meta").parameters())
    need, free = QWEN_BYTES_PER_PARAM * count, mem_available_bytes()
    if free is not None and need > free:
        notes.append(f"The {count / 1e6:.0f} M-parameter workload was skipped: it needs about {need / 1e9:.1f} GB "
                     f"of RAM and {free / 1e9:.1f} GB were available.")
        return None
    tcfg = TrainerConfig(lr=params["qwen_lr"], dtype="bfloat16", device="cpu", seed=0, groups_per_step=2,
                         micro_batch_size=params["qwen_groups"] * params["qwen_group_size"],
                         loss={"kind": "ppo", "clip_low": 0.2, "clip_high": 0.2})
    engine = build_engine(TrainModule(qwen_model(params["qwen_config"])), tcfg)
    first = engine.policy_state_dict()
    info = {"lr": tcfg.lr, "parameters": count, "weight_scale": weight_scale(first), "config": params["qwen_config"],
            "grad_norms": []}
    meter.add(first, 0)
    del first
    state = TrainState()
    for step in range(1, params["qwen_steps"] + 1):
        scored = synthetic_scored(engine, params, params["qwen_config"]["vocab_size"], step, state.version)
        started = time.perf_counter()
        metrics = train_step(engine, build_batch(scored), tcfg, state)
        if state.applied_updates != step:
            raise RuntimeError(f"qwen step {step}: the update was skipped (non-finite gradient): {metrics}")
        state.version = state.step
        info["grad_norms"].append(float(metrics.get("optim/grad_norm", float("nan"))))
        ctx.log(f"  qwen step {step}: trained in {time.perf_counter() - started:.1f} s")
        meter.add(engine.policy_state_dict(), step)
    return info


def summarise(key: str, steps: Sequence[StepBytes], figures: dict[str, float], samples: dict[str, list]) -> None:
    """Figures ``{key}.{what}``: medians over steps 2..N, and step 1's own values as ``{key}.step1_{what}``."""
    first, later = steps[0], steps[1:] or steps[:1]  # a single step stands for both
    values = {"sent_ratio": [s.sent_bytes / s.full_bytes for s in later],
              "delta_ratio": [s.delta_bytes / s.full_bytes for s in later if s.delta_bytes is not None],
              "changed": [s.changed for s in later], "changed_elements": [s.changed_elements for s in later],
              "encode_s": [s.encode_s for s in later],
              "rebuild_s": [s.rebuild_s for s in later if s.rebuild_s is not None]}
    for what, vals in values.items():
        if vals:
            samples[f"{key}.{what}"] = vals
            figures[f"{key}.{what}"] = float(statistics.median(vals))
    figures[f"{key}.full_mb"] = first.full_bytes / MB
    figures[f"{key}.step1_sent_ratio"] = first.sent_bytes / first.full_bytes
    figures[f"{key}.step1_changed"] = first.changed
    if first.delta_bytes is not None:
        figures[f"{key}.step1_delta_ratio"] = first.delta_bytes / first.full_bytes


def run(ctx: BenchContext) -> dict[str, Any]:
    params = sizes(ctx)
    notes: list[str] = []
    figures: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    steps: dict[str, list[dict[str, Any]]] = {}
    workloads: dict[str, Any] = {}
    for name, dtypes, measure in (("demo", ("float32", "bfloat16"), lambda m: demo_workload(ctx, params, m)),
                                  ("qwen", ("bfloat16",), lambda m: qwen_workload(ctx, params, m, notes))):
        ctx.log(f"  workload {name}")
        meter = DeltaMeter(dtypes)
        info = measure(meter)
        if info is None:
            continue
        workloads[name] = {**info, "dtypes": list(dtypes)}
        for dtype in dtypes:
            key = f"{name}.{dtype}"
            summarise(key, meter.steps[dtype], figures, samples)
            steps[key] = [dataclasses.asdict(s) for s in meter.steps[dtype]]
    params.update(max_delta_ratio=MAX_DELTA_RATIO, max_changed_fraction=MAX_CHANGED_FRACTION, goal=GOAL,
                  measured=list(steps))
    notes.append("In-process, the publisher's own functions (`flat_payload`, `encode_delta`, `apply_delta`); no "
                 "Kafka. Every delta was rebuilt with `apply_delta` and compared with the version's payload byte for "
                 "byte. Medians over steps 2..N; step 1 is listed apart.")
    return {"figures": figures, "samples": samples, "params": params, "notes": notes, "steps": steps,
            "workloads": workloads}


# ---------------------------------------------------------------- report


def keys(result: Mapping[str, Any]) -> list[str]:
    """The measured ``workload.dtype`` keys in the order they ran (the JSON file sorts its objects' keys)."""
    return list(result["params"]["measured"])


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.3g} %"


def _made(result: Mapping[str, Any], key: str) -> str:
    later = result["steps"][key][1:] or result["steps"][key][:1]
    return f"{sum(s['delta_bytes'] is not None for s in later)} of {len(later)}"


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["workload", "broadcast dtype", "full payload", "sent / full", "delta / full", "deltas made",
               "changed bytes", "changed elements", "step 1: sent / full (changed)", "encode", "rebuild",
               "publisher sends", f"goal ≤ {_pct(GOAL)}"]
    rows, f = [], result["figures"]
    for key in keys(result):
        name, dtype = key.split(".")
        info = result["workloads"][name]
        rows.append([f"{LABELS[name]} ({info['parameters'] / 1e6:.3g} M, lr {info['lr']:g})", dtype,
                     fmt(f[f"{key}.full_mb"], "MB"),
                     _pct(f[f"{key}.sent_ratio"]), _pct(f.get(f"{key}.delta_ratio")), _made(result, key),
                     _pct(f[f"{key}.changed"]), _pct(f[f"{key}.changed_elements"]),
                     f"{_pct(f[f'{key}.step1_sent_ratio'])} ({_pct(f[f'{key}.step1_changed'])})",
                     fmt(f[f"{key}.encode_s"], "s"), fmt(f.get(f"{key}.rebuild_s"), "s"), _decision(result, key),
                     "met" if f[f"{key}.sent_ratio"] <= GOAL else "not met"])
    return headers, rows


def _short(key: str) -> str:
    name, dtype = key.split(".")
    return f"{'0.5B' if name == 'qwen' else name} {'bf16' if dtype == 'bfloat16' else 'fp32'}"


def headline(result: Mapping[str, Any]) -> str:
    parts, f = [], result["figures"]
    for key in sorted(keys(result), key=lambda k: not k.startswith("qwen")):  # the 0.5 B model first
        sent, delta = f[f"{key}.sent_ratio"], f.get(f"{key}.delta_ratio")
        how = ("delta" if sent < 1 else f"no delta: {_pct(f[f'{key}.changed'])} of bytes change" if delta is None
               else f"its delta, {_pct(delta)}, is too big")
        parts.append(f"{_short(key)}: {_pct(sent)} of the full bytes per step ({how})")
    return "; ".join(parts) + f" (goal ≤ {_pct(GOAL)})"


def _ulp(scale: float, mantissa_bits: int) -> float:
    """Spacing of the floats around ``scale`` with ``mantissa_bits`` explicit mantissa bits."""
    return float(2.0 ** (np.floor(np.log2(scale)) - mantissa_bits))


def _decision(result: Mapping[str, Any], key: str) -> str:
    """What the publisher does with this broadcast's versions, and why (the limits of stream_rl.weights)."""
    f = result["figures"]
    if f.get(f"{key}.delta_ratio") is None:
        return f"full: changed bytes > {_pct(MAX_CHANGED_FRACTION)}, no delta made"
    if f[f"{key}.sent_ratio"] >= 1:
        return f"full: delta > {_pct(MAX_DELTA_RATIO)} of the payload"
    return "delta"


def more_tables(result: Mapping[str, Any]) -> str:
    """AdamW's step against the float spacing at the median weight, per workload (the reason bf16 deltas can be
    small and fp32 ones cannot)."""
    rows = []
    for name, info in result["workloads"].items():
        scale, lr = info["weight_scale"], info["lr"]
        rows.append([LABELS[name], f"{scale:.3g}", f"{lr:g}", f"{lr / _ulp(scale, 23):,.0f}",
                     f"{lr / _ulp(scale, 7):.2g}"])
    note = "" if "qwen" in result["workloads"] else "\n\nThe 0.5 B workload was skipped (see the note)."
    return md_table(["workload", "median abs weight", "lr", "lr in fp32 spacings there", "lr in bf16 spacings there"],
                    rows) + note
