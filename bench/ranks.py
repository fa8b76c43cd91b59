"""Benchmark 7, trainer ranks: the trainer's step on 1 and 2 data-parallel ranks, and the scaling model.

Consumes: the demo policy (:func:`bench.demo_runs.demo_dir`) and, for the extrapolation, the measured GPU trainer
step of ``bench/gpu_results.json`` (``bench/gpu.py`` on an H200: step time, parameter count).
Produces: per round (variants interleaved, at least 3 rounds) one launch of :mod:`bench.ranks_worker` through torch's
launcher for each variant: 1 rank on 1 thread, 1 rank on 2 threads (every core of this machine to one process),
2 ranks on 1 thread each (gloo). Each launch trains the same demo-shaped batch (256 rollouts, 6 response tokens)
for a few timed steps and times the gradient all-reduce alone. Figures: response tokens/s of each variant (median
step), the 2-rank speed-ups over both 1-rank variants, and the 2-rank step the scaling model predicts from the
1-rank step and the measured all-reduce, against the measured one.

The scaling model (strong scaling: one global batch split over N ranks, no overlap of the all-reduce with the
backward pass, which is how the torch engine works: one flat all-reduce after the last micro batch):
``t(N) = t_compute(1) / N + 2 (N - 1) / N * G / busbw``, G the fp32 gradient bytes, busbw the all-reduce bus
bandwidth (NCCL's definition). The extrapolation to 8 GPUs on one node and 16 on 2 nodes takes ``t_compute(1)``
and G from the measured H200 step and ASSUMES the bus bandwidths in :data:`ASSUMED_BUSBW` (not measured here).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench import demo_runs as dr
from bench.common import GPU_JSON, BenchContext, fmt, interleave, medians

TITLE = "Trainer ranks"
VARIANTS = {"r1t1": (1, 1), "r1t2": (1, 2), "r2t1": (2, 1)}  # name: (ranks, threads per rank)
ASSUMED_BUSBW = {"8 GPUs, 1 node (NVLink)": (8, 360e9), "16 GPUs, 2 nodes (8x400 Gb/s InfiniBand)": (16, 40e9)}
"""Assumed NCCL all-reduce bus bandwidth, bytes/s: ~360 GB/s is a typical nccl-tests figure inside an 8-GPU
NVLink-4 node, 40 GB/s a typical one across nodes with one 400 Gb/s NIC per GPU. Not measured by this project."""


def sizes(ctx: BenchContext) -> dict[str, int]:
    return ctx.pick(full={"rows": 256, "steps": 8}, quick={"rows": 256, "steps": 4}, tiny={"rows": 64, "steps": 2})


def _launch(policy: Path, out: Path, ranks: int, threads: int, rows: int, steps: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "bench.ranks_worker", str(policy), str(out), str(rows), str(steps)]
    # from the repo root: bench/ is a folder there, not an installed package
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=dr.ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"ranks worker ({ranks} x {threads} threads) failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def run(ctx: BenchContext) -> dict[str, Any]:
    demo, size = dr.demo_dir(ctx), sizes(ctx)
    facts: dict[str, Any] = {}

    def step(name: str):
        ranks, threads = VARIANTS[name]

        def measure() -> dict[str, float]:
            got = _launch(demo / "policy", ctx.workdir / f"ranks-{name}.json", ranks, threads, size["rows"],
                          size["steps"])
            facts.update(tokens=got["tokens"], grad_bytes=got["grad_bytes"])
            out = {f"{name}_step_s": statistics.median(got["step_s"])}
            if ranks > 1:
                out["allreduce_s"] = statistics.median(got["allreduce_s"])
            return out
        return name, measure

    samples = interleave([step(n) for n in VARIANTS], ctx.rounds, ctx.log, ctx.min_rounds)
    med = medians(samples)
    tokens = facts["tokens"]
    predicted = med["r1t1_step_s"] / 2 + med["allreduce_s"]  # 2 (N - 1) / N = 1 for N = 2
    figures = {f"{n}_tokens_s": tokens / med[f"{n}_step_s"] for n in VARIANTS}
    figures.update({
        "two_ranks_vs_one_thread": med["r1t1_step_s"] / med["r2t1_step_s"],
        "two_ranks_vs_two_threads": med["r1t2_step_s"] / med["r2t1_step_s"],
        "allreduce_ms": med["allreduce_s"] * 1e3, "allreduce_mb_s": facts["grad_bytes"] / med["allreduce_s"] / 1e6,
        "model_vs_measured": predicted / med["r2t1_step_s"],
    })
    return {"figures": figures, "samples": samples, "model": extrapolate(),
            "params": {**size, "tokens_per_step": tokens, "grad_bytes": facts["grad_bytes"],
                       "cores": dr.usable_cores(), "engine": "torch", "backend": "gloo"},
            "notes": ["each variant is a fresh launch through torch.distributed.run; the timed steps follow two "
                      "warm-up steps; the all-reduce is timed on its own after the steps"]}


def extrapolate(gpu_json: Path = GPU_JSON) -> dict[str, Any] | None:
    """The scaling model on the measured H200 step (module docstring); None without GPU results."""
    if not gpu_json.is_file():
        return None
    gpu = json.loads(gpu_json.read_text())
    step_s, params = gpu["figures"]["train_step_s"], gpu["params"]["model_params"]
    grad_bytes = 4 * params  # fp32 gradients (master weights are fp32 under bf16 mixed precision)
    rows = []
    for label, (n, busbw) in ASSUMED_BUSBW.items():
        reduce_s = 2 * (n - 1) / n * grad_bytes / busbw
        strong = step_s / n + reduce_s
        rows.append({"setup": label, "ranks": n, "busbw_gb_s": busbw / 1e9, "allreduce_s": reduce_s,
                     "step_s": strong, "speedup": step_s / strong, "weak_efficiency": step_s / (step_s + reduce_s)})
    return {"gpu": gpu["device"]["name"], "step_s": step_s, "params": params, "grad_bytes": grad_bytes,
            "batch": f"{gpu['params']['train_batch']} x {gpu['params']['train_len']} tokens", "rows": rows}


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    f = result["figures"]
    rows = [["1 rank, 1 thread", fmt(f["r1t1_tokens_s"]), "1×"],
            ["1 rank, 2 threads", fmt(f["r1t2_tokens_s"]), f"{fmt(f['r1t2_tokens_s'] / f['r1t1_tokens_s'])}×"],
            ["2 ranks, 1 thread each (gloo)", fmt(f["r2t1_tokens_s"]), f"**{fmt(f['two_ranks_vs_one_thread'])}×**"]]
    return ["trainer", "response tokens/s", "÷ 1 rank, 1 thread"], rows


def headline(result: Mapping[str, Any]) -> str:
    f = result["figures"]
    return (f"2 ranks {fmt(f['two_ranks_vs_one_thread'])}× one rank on one core, "
            f"{fmt(f['two_ranks_vs_two_threads'])}× one rank on both cores")


def _model_table(model: Mapping[str, Any] | None) -> str:
    if not model:
        return "(no GPU results: the extrapolation needs bench/gpu_results.json)"
    head = ("| setup | assumed busbw | all-reduce | step (strong scaling) | speed-up | weak-scaling efficiency |\n"
            "|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['setup']} | {fmt(r['busbw_gb_s'])} GB/s | {fmt(r['allreduce_s'] * 1e3)} ms | "
                   f"{fmt(r['step_s'] * 1e3)} ms | {fmt(r['speedup'])}× | {fmt(r['weak_efficiency'] * 100)} % |\n"
                   for r in model["rows"])
    return head + body


def more_tables(result: Mapping[str, Any]) -> str:
    """What the step costs besides compute, and the scaling model extrapolated to GPUs (from bench/gpu.py)."""
    f, p, model = result["figures"], result["params"], result.get("model")
    parts = [f"Per step: {p['rows']} rollouts, {p['tokens_per_step']} response tokens, {len(p['cores'])} cores.\n\n"
             "| measured | value |\n|---|---|\n"
             f"| all-reduce of the fp32 gradients (loopback TCP) | {fmt(p['grad_bytes'] / 1e6)} MB in "
             f"{fmt(f['allreduce_ms'])} ms ({fmt(f['allreduce_mb_s'])} MB/s) |\n"
             f"| scaling model t(2) = t(1)/2 + all-reduce, ÷ the measured 2-rank step | "
             f"{fmt(f['model_vs_measured'])}× |\n"]
    if model:
        parts.append(f"\nExtrapolated with that model from the measured {model['gpu']} step "
                     f"({fmt(model['step_s'] * 1e3)} ms, {fmt(model['params'] / 1e9)} B parameters, batch "
                     f"{model['batch']}, `bench/gpu.py`) and ASSUMED bus bandwidths (not measured here); strong "
                     f"scaling splits that one batch, weak scaling keeps the batch per GPU:\n\n")
    parts.append(_model_table(model))
    return "".join(parts)
