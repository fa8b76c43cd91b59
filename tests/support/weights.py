"""Test helpers moved from test_weights.py."""

from __future__ import annotations

import time

import torch


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


def _chunk_topics(transport, expect: list[str] | None = None, timeout_s: float = 10.0) -> list[str]:
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
