"""Rendering conversational prompts with the policy tokenizer's chat template, once, when the prompts are loaded.

Consumes: a tokenizer directory (``--tokenizer DIR``, else the config's policy), ``data.chat_template``
(``auto`` / ``none`` / a Jinja file, :mod:`stream_rl.prompts.templates`) and ``data.chat_template_kwargs``; then
the validated ``messages`` of each conversational row.
Produces: a :class:`ChatRenderer` whose :meth:`~ChatRenderer.render` gives ``(text, ids)``:

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=override, **chat_template_kwargs)
    ids  = tokenizer(text, add_special_tokens=False)["input_ids"]     # the template already holds BOS etc.

and :class:`TokenizerSource`, which loads the tokenizer at most once, and only when something needs it (a file
of plain ``text`` prompts never loads one unless tokens are counted).
With a row's ``tools`` (function specs) the call also passes ``tools=tools``, as transformers documents tool use.
Guarantees: ``none`` with messages, ``auto`` on a tokenizer without a template (naming its directory), an
unreadable template file and an unloadable tokenizer are each one :class:`PromptFileError`; a row with ``tools``
or an assistant's ``tool_calls`` whose template never mentions ``tools`` / ``tool_calls`` is a
:class:`RenderError` saying so (they would be dropped from the prompt without a word); a template that
raises on one row is a :class:`RenderError` naming the exception's type (for ``raise_exception`` in a template,
also its message, which the template's author wrote), never quoting the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stream_rl.prompts.schema import PromptFileError
from stream_rl.prompts.templates import template_override


class RenderError(ValueError):
    """One conversation could not be rendered; the message names the exception type, never the prompt."""


@dataclass
class TokenizerSource:
    """A tokenizer directory loaded on first use; ``origin`` says where the directory came from (for errors)."""

    directory: Path | None
    origin: str = "--tokenizer"
    _tokenizer: Any = field(default=None, repr=False)

    def get(self):
        if self.directory is None:
            raise PromptFileError(f"no tokenizer: {self.origin}")
        if self._tokenizer is None:
            from stream_rl.models.loading import ModelLoadError, load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.directory)
            except ModelLoadError as exc:
                raise PromptFileError(f"{self.origin}: {exc}") from None
        return self._tokenizer

    def count(self, text: str) -> int:
        """A plain text's tokens as the producer feeds it (the tokenizer's defaults, special tokens included)."""
        return len(self.get()(text)["input_ids"])


class ChatRenderer:
    """Renders messages with one tokenizer and template (module docstring for the exact calls)."""

    def __init__(self, tokenizer, template: str | None, kwargs: dict[str, Any] | None = None):
        self.tokenizer, self.template, self.kwargs = tokenizer, template, dict(kwargs or {})
        self._reads: dict[tuple[bool, str], bool] = {}

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> tuple[str, list[int]]:
        """``(text, ids)`` of the conversation followed by the assistant's generation prompt; ``tools`` (function
        specs) go to the template as ``apply_chat_template(..., tools=tools)`` passes them."""
        self._check_tool_use(messages, tools)
        extra = {} if tools is None else {"tools": list(tools)}
        try:
            text = self._apply(messages, extra)
        except Exception as exc:  # a template may raise anything (jinja2 errors, raise_exception, TypeError)
            as_text = _arguments_as_text(messages)
            if as_text is None:
                raise RenderError(f"the chat template raises {_described(exc)}") from None
            try:  # a template that writes `arguments` by concatenation (DeepSeek's) needs the JSON text
                text = self._apply(as_text, extra)
            except Exception:  # noqa: BLE001 - the first failure is the one to report
                raise RenderError(f"the chat template raises {_described(exc)}") from None
        if not isinstance(text, str):
            raise RenderError(f"the chat template returned {type(text).__name__}, not text")
        try:
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except Exception as exc:  # tokenizers raise plain Exception for text outside the vocabulary
            raise RenderError(f"the tokenizer rejects the rendered prompt ({type(exc).__name__})") from None
        if not ids:
            raise RenderError("the chat template renders it to no tokens")
        return text, ids


    def _apply(self, messages: Sequence[dict], extra: dict[str, Any]) -> Any:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                  chat_template=self.template, **extra, **self.kwargs)

    def _check_tool_use(self, messages: Sequence[dict], tools: Sequence[dict] | None) -> None:
        """RenderError when the row has tools or tool calls and the template never reads them (they would be left
        out of the prompt without a word)."""
        if tools is not None and not self._template_reads(True, "tools"):
            raise RenderError("the row has tools and the chat template never reads `tools`: they would be left out "
                              "of the prompt; use a template that supports tools (data.chat_template = a Jinja file)")
        if any("tool_calls" in m for m in messages) and not self._template_reads(tools is not None, "tool_calls"):
            raise RenderError("an assistant message has tool_calls and the chat template never reads `tool_calls`: "
                              "they would be left out of the prompt; use a template that supports tools")

    def _template_reads(self, with_tools: bool, name: str) -> bool:
        """Whether the template ``apply_chat_template`` would use mentions ``name`` (a variable or attribute)."""
        key = (with_tools, name)
        if key not in self._reads:
            source = self.template or getattr(self.tokenizer, "chat_template", None) or ""
            if isinstance(source, dict):  # named templates: transformers takes "tool_use" for a call with tools
                source = source.get("tool_use" if with_tools and "tool_use" in source else "default", "")
            self._reads[key] = _mentions(source, name)
        return self._reads[key]


def _arguments_as_text(messages: Sequence[dict]) -> list[dict] | None:
    """``messages`` with every tool call's object ``arguments`` written as JSON text (None: there is none)."""
    import json

    changed, out = False, []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls:
            new_calls = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), dict):
                    function = {**function, "arguments": json.dumps(function["arguments"], ensure_ascii=False)}
                    call, changed = {**call, "function": function}, True
                new_calls.append(call)
            message = {**message, "tool_calls": new_calls}
        out.append(message)
    return out if changed else None


def _mentions(template: str, name: str) -> bool:
    """``name`` appears in the Jinja template as a word (a variable it reads, an attribute or key it looks up)."""
    import re

    return re.search(rf"\b{re.escape(name)}\b", template) is not None


def _described(exc: Exception) -> str:
    """The exception's type; for a template's own ``raise_exception`` (jinja2 TemplateError) also its message."""
    name = type(exc).__name__
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:  # pragma: no cover - jinja2 comes with transformers
        return name
    if isinstance(exc, TemplateError) and str(exc):
        return f"{name}: {str(exc)[:160]}"
    return name


def chat_renderer(source: TokenizerSource, chat_template: str = "auto",
                  chat_template_kwargs: dict[str, Any] | None = None) -> ChatRenderer:
    """The renderer for ``data.chat_template``; :class:`PromptFileError` when messages cannot be rendered at all."""
    if chat_template == "none":
        raise PromptFileError("conversational prompts (messages) need a chat template, and data.chat_template is "
                              "'none': set it to 'auto' or a Jinja file, or write text prompts")
    try:
        override = template_override(chat_template)
    except ValueError as exc:
        raise PromptFileError(str(exc)) from None
    tokenizer = source.get()
    if override is None and not getattr(tokenizer, "chat_template", None):
        raise PromptFileError(f"the tokenizer in {source.directory} has no chat template (data.chat_template = "
                              "'auto'): set data.chat_template to a Jinja file, or write text prompts")
    return ChatRenderer(tokenizer, override, chat_template_kwargs)
