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
Guarantees: ``none`` with messages, ``auto`` on a tokenizer without a template (naming its directory), an
unreadable template file and an unloadable tokenizer are each one :class:`PromptFileError`; a template that
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

    def render(self, messages: Sequence[dict[str, str]]) -> tuple[str, list[int]]:
        """``(text, ids)`` of the conversation followed by the assistant's generation prompt."""
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                      chat_template=self.template, **self.kwargs)
        except Exception as exc:  # a template may raise anything (jinja2 errors, raise_exception, TypeError)
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
