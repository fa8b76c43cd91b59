"""Weights test helpers: a tiny Llama to publish, tensor equality, and the per-version chunk topics of a run."""

from __future__ import annotations

import time

import torch

from schemas import validate
from stream_rl.weights.payload import build_manifest


def tiny_llama(dtype: torch.dtype = torch.float32):
    """A real transformers Llama (hidden 64, 2 layers, 2 heads of dim 32) built from a config: ~95k parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype)


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def chunk_topics(transport, expect: list[str] | None = None, timeout_s: float = 10.0) -> list[str]:
    """The run's chunk topics; with ``expect``, polled until they equal it (topic deletion may lag a little)."""
    admin = transport.admin()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            now = sorted(t for t in admin.list_topics() if t.startswith(transport.names.weights + ".v"))
            if expect is None or now == expect or time.monotonic() > deadline:
                return now
            time.sleep(0.2)
    finally:
        admin.close()


def manifest_for(payload, version: int = 7, chunk_size: int = 40, **where):
    where = where or {"chunks_topic": f"stream-rl.x.weights.v{version}"}
    return validate(build_manifest(payload, version=version, step=3, mode="inline" if "chunks_topic" in where
                                   else "store", chunk_size=chunk_size, trainer_id="trainer-0", **where))


def flip_byte(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
