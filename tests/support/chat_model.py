"""A tiny chat policy: a random LlamaForCausalLM over :mod:`support.chat`'s ChatML character tokenizer, saved.

Consumes: nothing (no download). Produces: :func:`build_chat_model_dir`, a ``save_pretrained`` directory the
engines and the trainer load like any instruct model (safetensors weights, a tokenizer with a real Jinja chat
template).
Guarantees: the end-of-turn token ``<|im_end|>`` is the model's eos and is made about as likely as the model's
most sampled token (``eos_boost``), so a turn ends within a few tokens and multi-turn episodes do take turns;
the other special tokens (``<pad>``, ``<unk>``, ``<|im_start|>``) are made unlikely, so a sampled turn decodes to
the text its tokens spell.
"""

from __future__ import annotations

from pathlib import Path

import torch
from support.chat import build_chat_tokenizer


def chat_llama_config(tokenizer, max_positions: int = 512):
    """The tests' tiny Llama shape (hidden 64, 2 layers) for the chat tokenizer, with room for conversations."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=max_positions,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id)


def build_chat_model_dir(path: Path, seed: int = 0, eos_boost: float = 1.0) -> Path:
    """The tiny chat policy saved in ``path`` (see the module guarantees); returns ``path``."""
    from transformers import LlamaForCausalLM

    tokenizer = build_chat_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(chat_llama_config(tokenizer))
    with torch.no_grad():
        head = model.lm_head.weight  # [V, H]
        head.mul_(8.0)  # sharper than the default init, so samples are far from uniform
        text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12+34? Think first."}],
                                             tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        favourite = int(model(ids).logits[0].mean(dim=0).argmax())  # the most likely token on average
        head[tokenizer.eos_token_id] = head[favourite] * eos_boost
        for special in ("<pad>", "<unk>", "<|im_start|>"):
            head[tokenizer.convert_tokens_to_ids(special)] = -head[favourite]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)
