"""Prompt files: read and validate JSON lines, then publish one Prompt record per (prompt, epoch).

Consumes: a JSON-lines file, one object per line with ``prompt_id`` (optional: the line number is used), ``text``
(required), ``answer`` and ``metadata`` (optional).
Produces: :class:`schemas.Prompt` messages on the run's prompts topic, keyed by prompt_id, epoch by epoch.
Guarantees: the whole file is validated before anything is published (an error names the line and the field);
duplicate prompt ids are an error; the order within an epoch is shuffled with a fixed seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from schemas import ID_PATTERN, Prompt


class PromptFileError(ValueError):
    """A prompt file is malformed; the message names the file, line and field."""


@dataclass(frozen=True)
class PromptRow:
    prompt_id: str
    text: str
    answer: str | None
    metadata: dict[str, str]


def read_prompt_file(path: Path) -> list[PromptRow]:
    if not Path(path).is_file():
        raise PromptFileError(f"prompt file not found: {path}")
    rows, seen = [], set()
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = _parse_line(path, lineno, line)
        if row.prompt_id in seen:
            raise PromptFileError(f"{path}:{lineno}: prompt_id {row.prompt_id!r} appears twice")
        seen.add(row.prompt_id)
        rows.append(row)
    if not rows:
        raise PromptFileError(f"{path}: no prompts")
    return rows


def _parse_line(path: Path, lineno: int, line: str) -> PromptRow:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: expected a JSON object")
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        raise PromptFileError(f"{where}: field 'text' must be a non-empty string")
    prompt_id = str(obj.get("prompt_id", f"line{lineno}"))
    if not ID_PATTERN.match(prompt_id):
        raise PromptFileError(f"{where}: field 'prompt_id' {prompt_id!r} is not a valid id ({ID_PATTERN.pattern})")
    answer = obj.get("answer")
    if answer is not None and not isinstance(answer, str):
        answer = str(answer)
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise PromptFileError(f"{where}: field 'metadata' must be an object of strings")
    return PromptRow(prompt_id, text, answer, {str(k): str(v) for k, v in metadata.items()})


def prompt_messages(rows: list[PromptRow], epochs: int, group_size: int, seed: int = 0) -> list[Prompt]:
    """Prompt records for ``epochs`` passes over ``rows``, each epoch shuffled with ``seed + epoch``."""
    if epochs < 1:
        raise PromptFileError(f"epochs must be >= 1, got {epochs}")
    out = []
    for epoch in range(epochs):
        order = list(rows)
        random.Random(seed + epoch).shuffle(order)
        out.extend(Prompt(prompt_id=r.prompt_id, epoch=epoch, text=r.text, answer=r.answer, metadata=r.metadata,
                          group_size=group_size) for r in order)
    return out


def publish_prompts(transport, messages: list[Prompt]) -> int:
    """Send prompts keyed by prompt_id and wait for the broker's acknowledgements."""
    sink = transport.sink()
    try:
        for msg in messages:
            sink.send(transport.names.prompts, msg, key=msg.prompt_id)
        sink.flush()
    finally:
        sink.close()
    return len(messages)
