"""Tool calls in a sampled answer, in the format of the chat template that rendered the tools. No I/O.

Consumes: one chat call's sampled text decoded with its special tokens kept (a format's markers may be special
tokens of the model's tokenizer, e.g. Mistral's ``[TOOL_CALLS]``), the same text without them, the tokenizer's
special-token strings, and the call's id.
Produces: ``(content, tool_calls)`` in OpenAI's form (``{"id", "type": "function", "function": {"name",
"arguments": JSON text}}``), as the gateway answers them (:func:`parse`), and the format a chat template writes
(:func:`detect`, for ``gateway.tool_format = "auto"``).

Formats (the text a model of that family samples for a call, as its own template writes calls back):
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Hermes, and templates
  written like them).
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"[, "id"]}`` (Mistral v0.3,
  Nemo). Mistral's templates refuse an id that is not 9 letters or digits, so a sampled id of that shape is kept
  and any other call gets one of that shape derived from the call id.
Not read: DeepSeek's tool-call markers. DeepSeek's own templates (V3, R1 and its distills, V3.1) never render
``tools``, so the gateway refuses a call with tools on them (the tools would be left out of the prompt); an agent
that lists its tools in the system prompt parses DeepSeek's calls itself, and sends them back as OpenAI
``tool_calls``, which those templates render (their ``arguments`` as text: ``stream_rl.prompts.render``).

Guarantees: a call that does not parse (bad JSON, arguments that are not an object, no name) is not answered as a
call: with no call parsed, the content is the text without special tokens, exactly as without tools. With calls,
the content is the text outside them, special tokens removed, stripped; ``None`` when empty. ``arguments`` is the
sampled object written back with ``json.dumps`` (the agent sends it back; the template writes it again).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

FORMATS = ("hermes", "mistral")
_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
MISTRAL_MARK = "[TOOL_CALLS]"
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def detect(template: str | None) -> str:
    """The format the chat template writes tool calls in (by its own markers); ``hermes`` when it shows none."""
    source = template or ""
    return "mistral" if MISTRAL_MARK in source else "hermes"


def parse(fmt: str, raw: str, text: str, call_id: str, specials: Sequence[str]) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a sampled answer (module docstring); ``raw`` keeps special tokens, ``text``
    does not."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}: one of {', '.join(FORMATS)}")
    found = (_mistral if fmt == "mistral" else _hermes)(raw, call_id)
    if found is None:
        return text, []
    outside, calls = found
    content = _without(outside, specials).strip()
    return content or None, calls


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _object(value: object) -> dict | None:
    return value if isinstance(value, dict) else None


def _hermes(raw: str, call_id: str) -> tuple[str, list[dict]] | None:
    calls = []
    for j, match in enumerate(_HERMES.finditer(raw)):
        spec = _loads(match.group(1))
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            arguments = spec.get("arguments", {})
            if _object(arguments) is not None:
                calls.append(_call(f"{call_id}-{j}", spec["name"], json.dumps(arguments)))
    return (_HERMES.sub("", raw), calls) if calls else None


def _mistral(raw: str, call_id: str) -> tuple[str, list[dict]] | None:
    before, mark, after = raw.partition(MISTRAL_MARK)
    if not mark:
        return None
    try:
        specs, end = json.JSONDecoder().raw_decode(after.lstrip())
    except ValueError:
        return None
    if not isinstance(specs, list) or not specs:
        return None
    calls = []
    for j, spec in enumerate(specs):
        if not (isinstance(spec, dict) and isinstance(spec.get("name"), str)
                and _object(spec.get("arguments", {})) is not None):
            return None  # one malformed call spoils the list: it is left as content
        sampled = spec.get("id")
        ident = sampled if isinstance(sampled, str) and _MISTRAL_ID.fullmatch(sampled) else mistral_id(call_id, j)
        calls.append(_call(ident, spec["name"], json.dumps(spec.get("arguments", {}))))
    return before + after.lstrip()[end:], calls


def mistral_id(call_id: str, index: int) -> str:
    """A 9-character alphanumeric tool-call id (the only shape Mistral's templates accept), fixed by the call."""
    number = int.from_bytes(hashlib.sha256(f"{call_id}/{index}".encode()).digest()[:8], "big")
    out = ""
    for _ in range(9):
        number, digit = divmod(number, len(_ALPHABET))
        out += _ALPHABET[digit]
    return out


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _without(text: str, specials: Sequence[str]) -> str:
    for token in sorted((s for s in specials if s), key=len, reverse=True):
        text = text.replace(token, "")
    return text
