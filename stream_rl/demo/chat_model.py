"""A tiny chat model to try stream-rl's chat path with no download: a character tokenizer with a real Jinja chat
template (ChatML) and a random Llama that ends its turns. ``stream-rl demo chat-model DIR`` writes one.

Consumes: nothing (no download). Produces: :func:`build_chat_tokenizer` (a ``PreTrainedTokenizerFast``),
:func:`chat_llama_config` and :func:`build_chat_model_dir`, a ``save_pretrained`` directory the engines and the
trainer load like any instruct model (safetensors weights, a tokenizer with its chat template), for
``configs/chat_cpu.toml`` and the tests of conversational prompts and multi-turn chat.

Guarantees:
- Vocabulary: ``<pad>`` (id 0), ``<unk>`` (1), ``<|im_start|>`` (2), ``<|im_end|>`` (3), then one token per
  character of ``CHARACTERS`` (printable ASCII, ``\\n`` and ``\\t``) in that order, then ``specials``; any other
  character is ``<unk>``. Every character is one token; each special token is one id.
- ``eos_token = "<|im_end|>"`` (the end of an assistant turn), ``pad_token = "<pad>"``, no BOS, and
  ``add_special_tokens`` adds nothing (the template carries its own markers); padding on the left.
- ``chat_template`` is :data:`CHATML_TEMPLATE`: each message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``;
  ``add_generation_prompt=True`` appends ``<|im_start|>assistant\\n``, and then ``enable_thinking=False`` (a template
  kwarg, as Qwen3's) appends an empty think block.
- The model's end-of-turn token ``<|im_end|>`` is made about as likely as its most sampled token (``eos_boost``),
  so a turn ends within a few tokens; ``<pad>``, ``<unk>`` and ``<|im_start|>`` are made unlikely, so a sampled
  turn decodes to the text its tokens spell. It knows nothing: it is for trying the pipeline, not for results.
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, UNK, IM_START, IM_END = "<pad>", "<unk>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, UNK, IM_START, IM_END)
CHARACTERS = tuple(character for character in string.printable if character not in "\r\x0b\x0c")
MAX_LENGTH = 512
THINK_OFF = "<think>\n\n</think>\n\n"

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def build_chat_tokenizer(chat_template: str | None = CHATML_TEMPLATE, *, specials: tuple[str, ...] = (),
                         eos: str = IM_END, bos: str | None = None):
    """A fresh character-level chat tokenizer (``len(SPECIAL_TOKENS) + len(CHARACTERS)`` tokens, then
    ``specials`` not already among them, each a special token).

    ``chat_template=None`` builds the same tokenizer without a template (for "no template" error paths).
    ``eos`` / ``bos`` (each one of the special tokens) are the tokenizer's eos and bos tokens.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    markers = SPECIAL_TOKENS + tuple(dict.fromkeys(t for t in specials if t not in SPECIAL_TOKENS))
    vocab = {token: index for index, token in enumerate(markers[:len(SPECIAL_TOKENS)] + CHARACTERS
                                                        + markers[len(SPECIAL_TOKENS):])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in markers])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, unk_token=UNK, eos_token=eos, bos_token=bos,
        padding_side="left", model_max_length=MAX_LENGTH, clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def chat_llama_config(tokenizer, max_positions: int = 512):
    """A tiny Llama shape (hidden 64, 2 layers, ~0.1 M parameters) for the chat tokenizer, with room for chats."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=max_positions,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id)


def build_chat_model_dir(path: Path, seed: int = 0, eos_boost: float = 1.0) -> Path:
    """The tiny chat policy saved in ``path`` (see the module guarantees); returns ``path``."""
    import torch
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
