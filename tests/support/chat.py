"""A tiny chat tokenizer with a real Jinja chat template (ChatML-like), built locally with ``tokenizers``.

Consumes: nothing (no download). Produces: :func:`build_chat_tokenizer` (a ``PreTrainedTokenizerFast``) and
:func:`save_chat_tokenizer` (the same, ``save_pretrained`` into a directory that ``AutoTokenizer`` reloads offline),
for tests of conversational prompts, multi-turn chat and the chat-model end-to-end path.

Guarantees:
- Vocabulary: ``<pad>`` (id 0), ``<unk>`` (1), ``<|im_start|>`` (2), ``<|im_end|>`` (3), then one token per
  character of ``CHARACTERS`` (printable ASCII, ``\\n`` and ``\\t``) in that order; any other character is ``<unk>``.
  Every character is one token, so a string's token count is its length with each special token counted once.
- ``<|im_start|>`` / ``<|im_end|>`` are special tokens: written in a text they encode to one id each;
  ``eos_token = "<|im_end|>"``, ``pad_token = "<pad>"``, no BOS, and ``add_special_tokens`` adds nothing (ChatML
  templates carry their own markers), so ``tokenizer(rendered, add_special_tokens=False)`` is the rendering's ids.
- ``chat_template`` is :data:`CHATML_TEMPLATE`: each message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``;
  ``add_generation_prompt=True`` appends ``<|im_start|>assistant\\n``, and then ``enable_thinking=False`` (a template
  kwarg, as Qwen3's) appends an empty think block ``<think>\\n\\n</think>\\n\\n``. :func:`render_chatml` is the same
  rendering written in Python, for expected values in tests.
- :data:`RAISING_TEMPLATE` raises (``raise_exception``) on a message whose role is ``tool``; a template that
  raises, for error-path tests.
- Decoding joins characters with nothing in between (``Fuse``), so ``decode(encode(text))`` is ``text`` for text
  within ``CHARACTERS``. Padding is on the left, as generation needs.
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

RAISING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render_chatml(messages: list[dict[str, str]], add_generation_prompt: bool = True,
                  enable_thinking: bool | None = None) -> str:
    """:data:`CHATML_TEMPLATE`'s rendering in plain Python (the expected value of ``apply_chat_template``)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    if add_generation_prompt:
        text += f"{IM_START}assistant\n"
        if enable_thinking is False:
            text += THINK_OFF
    return text


def build_chat_tokenizer(chat_template: str | None = CHATML_TEMPLATE):
    """A fresh character-level chat tokenizer (``len(SPECIAL_TOKENS) + len(CHARACTERS)`` tokens).

    ``chat_template=None`` builds the same tokenizer without a template (for "no template" error paths).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, unk_token=UNK, eos_token=IM_END,
        padding_side="left", model_max_length=MAX_LENGTH, clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def save_chat_tokenizer(directory: Path, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """:func:`build_chat_tokenizer` saved with ``save_pretrained`` into ``directory`` (created); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_chat_tokenizer(chat_template).save_pretrained(directory)
    return directory
