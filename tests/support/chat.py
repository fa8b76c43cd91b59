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
- :data:`TOOLS_TEMPLATE` is Qwen2.5's tool-use template (its structure and markers, written out here): with
  ``tools`` a system turn lists each spec as JSON inside ``<tools></tools>``; an assistant turn with ``tool_calls``
  writes each call as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; ``tool`` messages become
  ``<tool_response>`` blocks of a user turn.
- :data:`RAISING_TEMPLATE` raises (``raise_exception``) on a message whose role is ``tool``; a template that
  raises, for error-path tests.
- Decoding joins characters with nothing in between (``Fuse``), so ``decode(encode(text))`` is ``text`` for text
  within ``CHARACTERS``. Padding is on the left, as generation needs.
- Other templates (``tests/support/templates/``, sources in its ``SOURCES.md``): :data:`TEMPLATE_SPECS` names each
  with the markers it writes and its eos/bos; :func:`build_template_tokenizer` builds the same character tokenizer
  with those markers as special tokens appended after ``CHARACTERS`` (one id each) and that eos/bos, so the
  existing ids and callers are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stream_rl.demo.chat_model import (  # the product's tiny chat tokenizer, its template and its markers
    CHARACTERS,
    CHATML_TEMPLATE,
    IM_END,
    IM_START,
    MAX_LENGTH,
    PAD,
    SPECIAL_TOKENS,
    THINK_OFF,
    UNK,
    build_chat_tokenizer,
)

__all__ = ["CHARACTERS", "CHATML_TEMPLATE", "IM_END", "IM_START", "MAX_LENGTH", "PAD", "RAISING_TEMPLATE",
           "SPECIAL_TOKENS", "TEMPLATE_SPECS", "THINK_OFF", "TOOLS_TEMPLATE", "UNK", "build_chat_tokenizer",
           "build_template_tokenizer", "render_chatml", "save_chat_tokenizer"]

TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
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


def save_chat_tokenizer(directory: Path, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """:func:`build_chat_tokenizer` saved with ``save_pretrained`` into ``directory`` (created); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_chat_tokenizer(chat_template).save_pretrained(directory)
    return directory


TEMPLATES_DIR = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class TemplateSpec:
    """A chat template of ``TEMPLATES_DIR`` (or ChatML) with the markers it writes and its tokenizer's eos/bos."""

    name: str
    file: str | None  # None: CHATML_TEMPLATE
    specials: tuple[str, ...]
    eos: str
    bos: str | None = None

    @property
    def template(self) -> str:
        return CHATML_TEMPLATE if self.file is None else (TEMPLATES_DIR / self.file).read_text(encoding="utf-8")


_DEEPSEEK = ("<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
             "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>")
DEEPSEEK_TOOL_MARKERS = tuple(f"<\uff5c{name.replace(' ', chr(0x2581))}\uff5c>" for name in (
    "tool calls begin", "tool calls end", "tool call begin", "tool call end", "tool sep", "tool outputs begin",
    "tool outputs end", "tool output begin", "tool output end"))  # DeepSeek-V3/R1's tool markers, special here
MISTRAL_NEMO = ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
_LLAMA3 = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
TEMPLATE_SPECS = {spec.name: spec for spec in (
    TemplateSpec("chatml", None, (), IM_END),
    TemplateSpec("qwen2.5", "qwen2.5-instruct.jinja", ("<|endoftext|>",), IM_END),
    TemplateSpec("phi-4", "phi-4.jinja", ("<|im_sep|>",), IM_END),
    TemplateSpec("llama-3.1-like", "llama-3.1-like.jinja", _LLAMA3, "<|eot_id|>", "<|begin_of_text|>"),
    TemplateSpec("gemma-2-like", "gemma-2-like.jinja", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
                 "<eos>", "<bos>"),
    TemplateSpec("phi-3.5", "phi-3.5-mini-instruct.jinja",
                 ("<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<|endoftext|>"),
    TemplateSpec("mistral-v0.3-like", "mistral-v0.3-like.jinja", ("<s>", "</s>", "[INST]", "[/INST]"), "</s>",
                 "<s>"),
    TemplateSpec("deepseek-r1-distill", "deepseek-r1-distill.jinja", _DEEPSEEK + DEEPSEEK_TOOL_MARKERS, _DEEPSEEK[1],
                 _DEEPSEEK[0]),
    TemplateSpec("mistral-nemo", "mistral-nemo-instruct-2407.jinja", MISTRAL_NEMO, "</s>", "<s>"),
)}


def build_template_tokenizer(name: str):
    """:func:`build_chat_tokenizer` for ``TEMPLATE_SPECS[name]``: its template, its markers as special tokens, its
    eos and bos."""
    spec = TEMPLATE_SPECS[name]
    return build_chat_tokenizer(spec.template, specials=spec.specials, eos=spec.eos, bos=spec.bos)
