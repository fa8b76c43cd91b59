"""Which chat template renders conversational prompts: the tokenizer's own, a Jinja file, or none.

Consumes: ``data.chat_template`` (``"auto"``, ``"none"`` or the path of a Jinja file).
Produces: the template text that overrides the tokenizer's own (:func:`template_override`; None: the tokenizer's
own, or no template at all for ``"none"``), for the prompt loader and for producers continuing a conversation.
Guarantees: a path that cannot be read is a :class:`ValueError` naming ``data.chat_template`` and the path.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATE_MODES = ("auto", "none")
"""The values of ``data.chat_template`` that are not a path."""


def template_override(mode: str) -> str | None:
    """The Jinja text of ``data.chat_template`` when it names a file; None for ``auto`` and ``none``."""
    if mode in TEMPLATE_MODES:
        return None
    path = Path(mode)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"data.chat_template: cannot read the template file {path}: "
                         f"{type(exc).__name__}: {exc}") from None
