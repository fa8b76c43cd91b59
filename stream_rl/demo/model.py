"""Tiny Llama models for the addition demo, built from a config (no download).

Consumes: the demo tokenizer (for the vocabulary size and the pad/bos/eos ids) and a seed.
Produces: a `LlamaForCausalLM` policy (hidden 128, 4 layers, 4 heads of dim 32, MLP 512; ~1.05 M parameters)
and, on request, a `LlamaForSequenceClassification` reward model of the same shape with one label.

Guarantees:
- head_dim is 32, the smallest vLLM accepts; `max_position_embeddings` is 64, enough for prompt plus answer.
- Word embeddings are NOT tied to the output head: every weight has its own name, so the state dict the trainer
  broadcasts is exactly what vLLM's `reload_weights` and the HF loader expect, with no tie to special-case.
- The same seed gives the same initial weights. Everything is float32.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

HIDDEN_SIZE = 128
NUM_LAYERS = 4
NUM_HEADS = 4
INTERMEDIATE_SIZE = 512
MAX_POSITIONS = 64
TIE_WORD_EMBEDDINGS = False


def demo_config(tokenizer, *, num_labels: int | None = None) -> LlamaConfig:
    """The demo's Llama config for `tokenizer`; `num_labels` is set for a sequence classifier only."""
    extra = {} if num_labels is None else {"num_labels": num_labels}
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        intermediate_size=INTERMEDIATE_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=TIE_WORD_EMBEDDINGS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
        **extra,
    )


def build_policy(tokenizer, *, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised demo policy whose generation config samples at temperature 1 with no top-k/top-p."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(demo_config(tokenizer))
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=6,
    )
    return model


def build_reward_model(tokenizer, *, seed: int = 0) -> LlamaForSequenceClassification:
    """A freshly initialised one-label sequence classifier with the demo policy's shape."""
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(demo_config(tokenizer, num_labels=1))


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied ones counted once)."""
    return sum(param.numel() for param in model.parameters())
