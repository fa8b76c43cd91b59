"""Dataset layouts: which columns of a file hold the prompt, the answer, the id and the metadata.

Consumes: a file's columns (Parquet / ``datasets`` schema names, or every key seen in a JSON-lines file), an
optional explicit :class:`Mapping` (``--prompt-key`` ... or ``data.*``), then each decoded record.
Produces: a :class:`Layout` (detected once per file, reported by ``prompts validate``) and, per record, the plain
record of :mod:`stream_rl.prompts.schema` (``text`` or ``messages``, ``prompt_id``, ``answer``, ``metadata``) with
the names of the columns each field came from, so every problem names the user's column.

Layouts (detected in this order, first match wins):

============  ==========================================  ===========================  =============================
layout        detected when the columns hold              prompt                       answer
============  ==========================================  ===========================  =============================
``plain``     ``text`` or ``messages`` (or no column)     ``text`` / ``messages``      ``answer``
``verl``      ``prompt`` and ``data_source`` or           ``prompt`` (messages)        ``reward_model.ground_truth``
              ``reward_model``
``trl``       ``prompt``                                  ``prompt`` (text/messages)   ``solution``, else ``answer``
``openrlhf``  ``prompt`` and ``label`` (no ``solution``   ``prompt`` (text/messages)   ``label`` (OpenRLHF's
              or ``answer``)                                                           ``--label_key``)
============  ==========================================  ===========================  =============================

An explicit ``prompt_key`` makes the layout ``mapped``; explicit ``answer_key`` / ``id_key`` / ``metadata_keys``
replace the detected ones in any layout. The id is ``prompt_id`` when present (else the line or row number).
Metadata columns (default: ``data_source``, ``ability``, ``extra_info`` when present) become string tags by
:func:`flatten_tags`; the plain ``metadata`` object (strings only) is copied as is and always read, and so is a
``tools`` column (the function specs of a tool-use prompt, :mod:`stream_rl.prompts.tools`) in every layout.

Guarantees: a mapped column that is not in the file is a :class:`PromptFileError` naming the flag, the column and
the columns there are; a mapped key that no record holds (a nested typo, ``reward_model.groundtruth``) is found by
:class:`MappedKeys`, whose problem names the flag and the keys there are; tags are deterministic (sorted dotted
keys, compact JSON for non-strings); a tag set twice (by ``metadata`` and a column) is a problem of that line naming
both; nothing here quotes sample text.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from stream_rl.prompts.schema import Problem, PromptFileError

LAYOUTS = ("plain", "verl", "trl", "openrlhf", "mapped")
DEFAULT_METADATA_KEYS = ("data_source", "ability", "extra_info")
_MISSING = object()


@dataclass(frozen=True)
class Mapping:
    """Explicit column choices (``None``: detected); dotted keys reach into nested objects."""

    prompt_key: str | None = None
    answer_key: str | None = None
    id_key: str | None = None
    metadata_keys: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Layout:
    """How one file's records are read: ``prompt_key`` None means the plain ``text`` / ``messages`` pair."""

    name: str
    prompt_key: str | None
    answer_key: str | None
    id_key: str | None
    metadata_keys: tuple[str, ...]

    def columns_used(self) -> set[str]:
        """The top-level columns this layout reads (every other column is an unknown field)."""
        keys = [self.prompt_key, self.answer_key, self.id_key, *self.metadata_keys, "metadata", "tools"]
        used = {key.split(".", 1)[0] for key in keys if key}
        return used | ({"text", "messages"} if self.prompt_key is None else set())

    def describe(self) -> dict:
        return {"name": self.name, "prompt": self.prompt_key or "text|messages", "answer": self.answer_key,
                "id": self.id_key, "metadata": list(self.metadata_keys)}


def detect_layout(columns: Collection[str], mapping: Mapping | None = None) -> Layout:
    """The layout of a file with these top-level ``columns``; :class:`PromptFileError` for a mapped column that
    is not there, or when no column can hold the prompt."""
    m = mapping or Mapping()
    cols = set(columns)
    for flag, key in _mapped(m):
        if key.split(".", 1)[0] not in cols and key not in cols:
            raise PromptFileError(f"{flag}: column {key!r} is not in the file (columns: {_listed(cols)})")
    name, prompt, answer = _detected(cols, m.prompt_key)
    metadata = m.metadata_keys if m.metadata_keys is not None else \
        tuple(k for k in DEFAULT_METADATA_KEYS if k in cols)
    return Layout(name, prompt, m.answer_key or answer, m.id_key or ("prompt_id" if "prompt_id" in cols else None),
                  tuple(metadata))


def _mapped(m: Mapping) -> list[tuple[str, str]]:
    """``(flag, key)`` of every key the mapping names explicitly."""
    named = [("--prompt-key / data.prompt_key", m.prompt_key), ("--answer-key / data.answer_key", m.answer_key),
             ("--id-key / data.id_key", m.id_key),
             *(("--metadata-keys / data.metadata_keys", k) for k in m.metadata_keys or ())]
    return [(flag, key) for flag, key in named if key is not None]


class MappedKeys:
    """The keys a :class:`Mapping` names explicitly, and whether any record holds each: a key no record holds
    names nothing (its answers or ids would all be missing), so :meth:`problems` makes it an error."""

    def __init__(self, mapping: Mapping):
        self.flags = {key: flag for flag, key in _mapped(mapping)}
        self.found: set[str] = set()
        self.nested: dict[str, set[str]] = {}  # parent of a dotted key -> the keys seen under it

    def see(self, record: object) -> None:
        if not isinstance(record, dict):
            return
        for key in self.flags.keys() - self.found:
            if lookup(record, key) is not _MISSING:
                self.found.add(key)
            elif "." in key:
                parent = key.rsplit(".", 1)[0]
                value = lookup(record, parent)
                if isinstance(value, dict) and len(self.nested.get(parent, ())) < 100:
                    self.nested.setdefault(parent, set()).update(map(str, value))

    def problems(self, columns: Collection[str], unit: str) -> list[Problem]:
        """One error (line 0) per mapped key that no record held, naming the keys its parent has, or the columns."""
        out = []
        for key, flag in self.flags.items():
            if key in self.found:
                continue
            parent = key.rsplit(".", 1)[0] if "." in key else None
            there = f"{parent!r} has keys: {_listed(self.nested[parent])}" if parent in self.nested \
                else f"columns: {_listed(columns)}"
            out.append(Problem(0, key, f"{flag}: {key!r} names nothing: no {unit} has it ({there})"))
        return out


def _detected(cols: set[str], prompt_key: str | None) -> tuple[str, str | None, str | None]:
    """(layout name, prompt key, default answer key) from the columns."""
    trl_answer = "solution" if "solution" in cols else "answer" if "answer" in cols else None
    if prompt_key is not None:
        answer = "reward_model.ground_truth" if "reward_model" in cols else trl_answer or \
            ("label" if "label" in cols else None)
        return "mapped", prompt_key, answer
    if "text" in cols or "messages" in cols or not cols:  # no columns: an empty or unreadable file, reported later
        return "plain", None, "answer" if "answer" in cols else None
    if "prompt" in cols and ("data_source" in cols or "reward_model" in cols):
        return "verl", "prompt", "reward_model.ground_truth" if "reward_model" in cols else trl_answer
    if "prompt" in cols and trl_answer is None and "label" in cols:
        return "openrlhf", "prompt", "label"
    if "prompt" in cols:
        return "trl", "prompt", trl_answer
    raise PromptFileError(f"no prompt column: expected text or messages (plain), prompt (verl, TRL), or "
                          f"--prompt-key / data.prompt_key naming one (columns: {_listed(cols)})")


def _listed(cols: Collection[str]) -> str:
    shown = sorted(cols)
    return ", ".join(shown[:30]) + (f", ... ({len(shown)} in all)" if len(shown) > 30 else "") if shown else "none"


def lookup(record: dict, key: str) -> object:
    """``record[key]``, or for a dotted key the nested member (a literal dotted column wins); ``_MISSING``."""
    if key in record:
        return record[key]
    value: object = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def plain_record(record: dict, layout: Layout, line: int) -> tuple[dict, dict[str, str], list[Problem]]:
    """The record in the plain schema's fields, the column each came from, and tag problems of this line."""
    names: dict[str, str] = {}
    out: dict = {"metadata": record.get("metadata"), "tools": record.get("tools")}
    if layout.prompt_key is None:
        out["text"], out["messages"] = record.get("text"), record.get("messages")
    else:
        value = lookup(record, layout.prompt_key)
        value = None if value is _MISSING else value
        field = "messages" if isinstance(value, list) else "text"
        out[field] = value
        names["text"] = names["messages"] = layout.prompt_key
    for field, key in (("answer", layout.answer_key), ("prompt_id", layout.id_key)):
        if key is not None:
            value = lookup(record, key)
            out[field] = None if value is _MISSING else value
            names[field] = key
    tags, problems = _tags(record, layout.metadata_keys, line)
    if tags:
        base = out["metadata"] if isinstance(out["metadata"], dict) else {}
        clash = sorted(set(base) & set(tags))
        if clash:
            problems.append(Problem(line, "metadata", f"tag {clash[0]!r} is set both by metadata and by a metadata "
                                    "column"))
        elif out["metadata"] is None or isinstance(out["metadata"], dict):
            out["metadata"] = {**base, **tags}
    return out, names, problems


def _tags(record: dict, keys: Sequence[str], line: int) -> tuple[dict[str, str], list[Problem]]:
    tags: dict[str, str] = {}
    problems: list[Problem] = []
    for key in keys:
        value = lookup(record, key)
        if value is _MISSING or value is None:
            continue
        for tag, text in flatten_tags(value, key).items():
            if tag in tags:
                problems.append(Problem(line, key, f"tag {tag!r} is set by two metadata columns"))
            tags[tag] = text
    return tags, problems


def flatten_tags(value: object, prefix: str) -> dict[str, str]:
    """String tags of ``value`` under ``prefix``: an object becomes one tag per leaf, keyed by its dotted path
    (``extra_info.split``), in sorted key order, null members left out; a string is itself; any other value
    (number, boolean, list) is its compact JSON (``[1,2]``, ``true``; non-JSON types by ``str``)."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key in sorted(value, key=str):
            if value[key] is not None:
                out.update(flatten_tags(value[key], f"{prefix}.{key}"))
        return out
    if isinstance(value, str):
        return {prefix: value}
    return {prefix: json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False, default=str)}


def unknown_columns(record: dict, layout: Layout) -> list[str]:
    """The top-level keys of ``record`` the layout does not read, in record order."""
    used = layout.columns_used()
    return [str(key) for key in record if key not in used]
