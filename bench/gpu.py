"""The GPU measurement script: ``python -m bench.gpu --out DIR [--device cuda] [--tiny] [--repeats 3]``.

Consumes: one accelerator (or ``--device cpu --tiny`` to check the code path here), nothing from the network.
Produces: ``DIR/gpu_results.json`` (also printed): the device, torch/CUDA/transformers versions, and medians of
(a) generation tokens/s of the project's HF engine (``producers.engines.hf.HFEngine``: its decode loop over a
transformers model, with exact behaviour logprobs; measured when that engine still called ``generate``) on a Llama-shaped model built from a config (random init, bf16);
(b) trainer tokens/s: forward + backward + AdamW step of the decoupled PPO loss of :mod:`stream_rl.algorithms`
(fp32 master weights, bf16 autocast on CUDA) on the same model shape;
(c) weight broadcast: the product's store-mode path minus Kafka (``stream_rl.weights.payload``: snapshot to CPU,
``save_store_file`` (safetensors written straight to the file, hashed once through a memory map), fsync, rename;
then ``tensors_from_store`` (the file mapped, its digest and index verified) and a copy into a second model
through the engine's strict ``load_weights``), the same without the file (safetensors bytes in memory, hashed on
both sides), against a plain ``safetensors`` save_file + load_file of the same tensors to local disk.
Guarantees: imports only torch, transformers, safetensors, numpy-free stdlib and the project's pure modules that do
not import pydantic, kafka-python or OpenTelemetry (the GPU machine has none of them; a test checks this with those
imports blocked); every figure is a median of ``--repeats`` (>= 3) runs after one warm-up run; the received weights
are checked bit-exact against the sent ones once, outside the timers. Copy ``gpu_results.json`` to ``bench/`` to
have ``python -m bench.run --render`` add it to ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from producers.engines.base import Sampling

MIN_REPEATS = 3
SHAPES = {  # Llama-shaped, random init
    "full": dict(hidden_size=2048, num_hidden_layers=12, intermediate_size=5632, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=128),
}
SIZES = {
    "full": dict(gen_batch=64, gen_prompt=64, gen_new=256, train_batch=16, train_prompt=128, train_len=512),
    "tiny": dict(gen_batch=4, gen_prompt=8, gen_new=8, train_batch=2, train_prompt=8, train_len=32),
}
EOS, PAD = 2, 0  # token ids the engine stops on / pads with; prompts never contain them


def build_model(shape: dict[str, int], device: str, dtype: torch.dtype, seed: int = 0):
    """A ``LlamaForCausalLM`` from a config, randomly initialised (seeded) directly on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def repeat(fn: Callable[[], dict[str, float]], repeats: int, log: Callable[[str], None], label: str
           ) -> dict[str, list[float]]:
    """One warm-up call, then ``repeats`` calls; each returns ``{name: value}``; the samples in call order."""
    fn()
    samples: dict[str, list[float]] = {}
    for i in range(repeats):
        for name, value in fn().items():
            samples.setdefault(name, []).append(float(value))
        log(f"  {label}: run {i + 1}/{repeats} done")
    return samples


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()  # ids 0-2 are pad/bos/eos


# ---------------------------------------------------------------- (a) generation


def measure_generation(engine, sizes: dict[str, int], vocab: int, device: str, repeats: int, log) -> dict:
    prompts = random_prompts(sizes["gen_batch"], sizes["gen_prompt"], vocab, seed=1)
    calls = iter(range(1_000_000))

    def one() -> dict[str, float]:
        sync(device)
        start = time.perf_counter()
        groups = engine.generate(prompts, n=1, sampling=Sampling(1.0),
                                 max_new_tokens=sizes["gen_new"], seed=next(calls))
        sync(device)
        seconds = time.perf_counter() - start
        tokens = sum(len(s.token_ids) for group in groups for s in group)
        return {"gen_s": seconds, "gen_tokens": tokens, "gen_tokens_s": tokens / seconds}

    return repeat(one, repeats, log, "generation")


# ---------------------------------------------------------------- (b) training


def train_inputs(sizes: dict[str, int], vocab: int, device: str) -> dict[str, torch.Tensor]:
    """Token ids [B, L], response mask [B, L-1] (positions predicting response tokens), advantages and the
    behaviour logprobs (a little off the proximal ones, as a stale sampler's would be)."""
    b, length, prompt = sizes["train_batch"], sizes["train_len"], sizes["train_prompt"]
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (b, length), generator=gen)
    mask = torch.zeros(b, length - 1, dtype=torch.bool)
    mask[:, prompt - 1:] = True
    adv = torch.randn(b, 1, generator=gen).expand(b, length - 1).contiguous()
    noise = 0.05 * torch.randn(b, length - 1, generator=gen)
    return {k: v.to(device) for k, v in dict(ids=ids, mask=mask, adv=adv, noise=noise).items()}


def _logp(model, ids: torch.Tensor, autocast: bool) -> torch.Tensor:
    from stream_rl.algorithms import logprobs_from_logits

    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits[:, :-1]  # [B, L-1, V]
    return logprobs_from_logits(logits, ids[:, 1:])  # [B, L-1]


def measure_training(model, sizes: dict[str, int], vocab: int, device: str, repeats: int, log) -> dict:
    """Forward + backward + AdamW step of the decoupled PPO loss (truncated IS against the behaviour logprobs)."""
    from stream_rl.algorithms import LossSpec, policy_loss

    batch = train_inputs(sizes, vocab, device)
    autocast = device.startswith("cuda")
    with torch.no_grad():
        old = _logp(model, batch["ids"], autocast).float()  # proximal policy: the model before any step
    behaviour = old + batch["noise"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99))
    model.train()
    tokens = batch["ids"].numel()
    response = int(batch["mask"].sum())

    def one() -> dict[str, float]:
        sync(device)
        start = time.perf_counter()
        logp = _logp(model, batch["ids"], autocast)
        loss, _ = policy_loss(logp, old, batch["adv"], batch["mask"], LossSpec(is_cap=5.0), behavior_logp=behaviour)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        seconds = time.perf_counter() - start
        if not torch.isfinite(loss):
            raise RuntimeError(f"training loss is not finite: {loss.item()}")
        return {"train_step_s": seconds, "train_tokens_s": tokens / seconds,
                "train_response_tokens_s": response / seconds}

    return repeat(one, repeats, log, "training")


# ---------------------------------------------------------------- (c) weight broadcast


def broadcast_variants(sender, engine, workdir: Path, device: str) -> list[tuple[str, Callable[[], dict]]]:
    """The three ways of moving ``sender``'s weights into ``engine``'s model, each timing itself."""
    from safetensors.torch import load, load_file, save, save_file

    from stream_rl.models.loading import state_dict_for_broadcast
    from stream_rl.storage.fsync import fsync_path
    from stream_rl.weights.payload import build_manifest, prepare, save_store_file, tensors_from_store

    version = iter(range(1, 1_000_000))

    def publish() -> tuple[bytes, str]:
        data = save(state_dict_for_broadcast(sender))
        return data, hashlib.sha256(data).hexdigest()

    def receive(data: bytes, digest: str) -> None:
        if hashlib.sha256(data).hexdigest() != digest:
            raise RuntimeError("weights digest mismatch after the round trip")
        engine.load_weights(load(data), next(version))
        sync(device)

    def store() -> dict[str, float]:  # the product's store path (stream_rl.weights.payload), minus Kafka
        start = time.perf_counter()
        path, tmp = workdir / "v.safetensors", workdir / ".v.safetensors.tmp"
        stored = save_store_file(prepare(state_dict_for_broadcast(sender)), tmp)
        manifest = build_manifest(stored, version=next(version), step=0, mode="store", chunk_size=1 << 20,
                                  trainer_id="trainer-0", store_uri=path.as_uri())
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(workdir)
        published = time.perf_counter()
        engine.load_weights(tensors_from_store(manifest, path), manifest.version)
        sync(device)
        end = time.perf_counter()
        return {"store_s": end - start, "store_publish_s": published - start, "store_fetch_s": end - published}

    def memory() -> dict[str, float]:
        start = time.perf_counter()
        receive(*publish())
        return {"memory_s": time.perf_counter() - start}

    def disk() -> dict[str, float]:
        start = time.perf_counter()
        path = workdir / "plain.safetensors"
        save_file(state_dict_for_broadcast(sender), str(path))
        engine.load_weights(load_file(str(path), device=device), next(version))
        sync(device)
        return {"disk_s": time.perf_counter() - start}

    return [("store", store), ("memory", memory), ("disk", disk)]


def check_same_weights(sender, receiver) -> None:
    """Raise unless every tensor of ``receiver`` equals ``sender``'s bit for bit (tied names included)."""
    sent, got = sender.state_dict(), receiver.state_dict()
    bad = [name for name in sent if not torch.equal(sent[name], got[name])]
    if bad:
        raise RuntimeError(f"received weights differ from the sent ones: {bad[:5]}")


def measure_broadcast(sender, engine, device: str, repeats: int, log) -> dict:
    """Warm-up round, check the copy, then ``repeats`` rounds with the variants interleaved."""
    with tempfile.TemporaryDirectory(prefix="stream-rl-gpu-") as tmp:
        variants = broadcast_variants(sender, engine, Path(tmp), device)
        for _, fn in variants:
            fn()
        check_same_weights(sender, engine.model)
        samples: dict[str, list[float]] = {}
        for i in range(repeats):
            for _, fn in variants:
                for name, value in fn().items():
                    samples.setdefault(name, []).append(value)
            log(f"  broadcast: round {i + 1}/{repeats} done")
    return samples


# ---------------------------------------------------------------- the run


def device_info(device: str) -> dict[str, str]:
    import transformers

    info = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": str(torch.version.cuda), "python": platform.python_version(), "host_cpus": str(os.cpu_count())}
    if device.startswith("cuda"):
        info["name"] = torch.cuda.get_device_name(torch.device(device))
        info["memory_gib"] = f"{torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30:.0f}"
    else:
        info["name"] = f"CPU ({platform.processor() or platform.machine()})"
    return info


def figures_from(samples: dict[str, list[float]], weight_bytes: int) -> dict[str, float]:
    figures = {name: float(statistics.median(values)) for name, values in samples.items()}
    mb = weight_bytes / 1e6
    figures["weights_mb"] = mb
    figures["store_vs_disk"] = figures["store_s"] / figures["disk_s"]
    figures["memory_vs_disk"] = figures["memory_s"] / figures["disk_s"]
    figures["store_mb_s"] = mb / figures["store_s"]
    return figures


def measure(mode: str, device: str, repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    """All three measurements; the result that ``gpu_results.json`` holds."""
    from producers.engines.hf import HFEngine

    shape, sizes = SHAPES[mode], SIZES[mode]
    tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1)
    started = time.monotonic()
    gen_model = build_model(shape, device, torch.bfloat16, seed=0)
    params = sum(p.numel() for p in gen_model.parameters())
    log(f"model: {params / 1e6:.0f} M parameters on {device}")
    engine = HFEngine(gen_model, tokenizer)
    samples = measure_generation(engine, sizes, shape["vocab_size"], device, repeats, log)
    train_model = build_model(shape, device, torch.float32, seed=0)
    samples |= measure_training(train_model, sizes, shape["vocab_size"], device, repeats, log)
    del train_model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    receiver = HFEngine(build_model(shape, device, torch.bfloat16, seed=1), tokenizer)
    samples |= measure_broadcast(gen_model, receiver, device, repeats, log)
    weight_bytes = sum(t.numel() * t.element_size() for t in gen_model.state_dict().values())
    result = {"figures": figures_from(samples, weight_bytes), "samples": samples, "device": device_info(device),
              "params": {"mode": mode, "repeats": repeats, "model_params": params, "model_shape": shape, **sizes,
                         "store_path": STORE_PATH, "hf_engine": HF_ENGINE,
                         "gen_dtype": "bfloat16", "train_dtype": "float32 + bf16 autocast" if
                         device.startswith("cuda") else "float32", "optimizer": "AdamW", "loss": "decoupled PPO "
                         "(clip 0.2, truncated IS cap 5)"},
              "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "wall_s": time.monotonic() - started}
    if device.startswith("cuda"):
        result["params"]["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


STORE_PATH = "mapped"
HF_ENGINE = "decode-loop"
"""The HF engine the generation figure measures: ``decode-loop`` = its own loop with one prefill per prompt (since
2026-12-02); results without it were measured when it called transformers' ``generate``."""
"""The store path the broadcast figure measures: ``mapped`` = save_store_file + tensors_from_store (since
2026-12-01); results without it were measured with the earlier path (whole file in memory, read back whole)."""


# ---------------------------------------------------------------- Markdown (for bench.common's GPU section)


def section(result: dict[str, Any]) -> str:
    """The body of the GPU section of docs/benchmarks.md for one ``gpu_results.json``."""
    from bench.common import fmt, md_table

    f, p, d = result["figures"], result["params"], result["device"]
    rows = [
        ["generation (HF engine, sampling)", f"{fmt(f['gen_tokens_s'], 'tokens/s')}",
         f"{p['gen_batch']} prompts x {p['gen_new']} new tokens, {p['gen_dtype']}, {fmt(f['gen_s'], 's')} per batch"],
        ["training (fwd + bwd + AdamW)", f"{fmt(f['train_tokens_s'], 'tokens/s')}",
         f"micro-batch {p['train_batch']} x {p['train_len']} tokens, {p['train_dtype']}, "
         f"{fmt(f['train_step_s'], 's')} per step"],
        ["weight broadcast, store path minus Kafka", fmt(f["store_s"], "s"),
         f"{fmt(f['weights_mb'], 'MB')}: publish {fmt(f['store_publish_s'], 's')} + fetch "
         f"{fmt(f['store_fetch_s'], 's')}; {fmt(f['store_vs_disk'])}x plain safetensors"],
        ["same, bytes in memory (no file)", fmt(f["memory_s"], "s"), f"{fmt(f['memory_vs_disk'])}x plain safetensors"],
        ["plain safetensors save_file + load_file", fmt(f["disk_s"], "s"), "to local disk and onto the device"],
    ]
    head = (f"Measured on **{d['name']}** ({d.get('memory_gib', '?')} GiB) with torch {d['torch']} (CUDA "
            f"{d['cuda']}), transformers {d['transformers']}, {result['measured_at']}, by `python -m bench.gpu` "
            f"({p['mode']} mode, median of {p['repeats']} after a warm-up). Model: Llama-shaped, "
            f"{p['model_params'] / 1e6:.0f} M parameters, random init, built from a config.\n\n")
    note = "" if p.get("store_path") == STORE_PATH else (
        "\nThe weight-broadcast rows were measured with the store path of that date, which serialized the whole "
        "file in memory and read it back whole; the script now times the memory-mapped path "
        "(`save_store_file`, `tensors_from_store`), which no GPU session has measured yet.\n")
    if p.get("hf_engine") != HF_ENGINE:
        note += ("\nThe generation row was measured when the HF engine sampled with transformers' `generate`; it "
                 "now runs its own decode loop (one prefill per prompt), which no GPU session has measured yet.\n")
    return head + md_table(["what", "median", "setting"], rows) + "\n" + note


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_results.json")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny model and sizes: checks the code path only")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"runs per figure (>= {MIN_REPEATS})")
    args = parser.parse_args(argv)
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats must be >= {MIN_REPEATS}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda asked for but torch sees no CUDA device (use --device cpu --tiny to test)")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = measure("tiny" if args.tiny else "full", args.device, args.repeats, log)
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2, sort_keys=True) + "\n"
    (args.out / "gpu_results.json").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
