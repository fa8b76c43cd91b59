"""The prompt-file schema: one decoded record checked field by field.

Consumes: one record as decoded from a JSON line or a Parquet row, with its 1-based line (or row) number.
Produces: a :class:`PromptRow`, or the :class:`Problem` list saying why the record is not one.

Schema (the reference table is in ``docs/prompts.md``):

=============  =========================================================  ========================================
field          accepted values                                            when absent or null
=============  =========================================================  ========================================
``text``       a string with at least one non-whitespace character        error
``prompt_id``  a string matching ``schemas.ID_PATTERN``, <= 200 chars     ``line{N}`` (JSON lines) / ``row{N}``
``answer``     a string, or an integer (published as its decimal form)   ``None``
``metadata``   an object (Parquet: map or struct) of string -> string    ``{}``
=============  =========================================================  ========================================

Guarantees: every problem carries the line and the field; a message quotes ids, field names and type names but
never a prompt or answer value, so reports and logs stay free of sample text. Fields outside the table are
reported by :func:`unknown_fields` and left to the caller (a warning by default, an error with ``strict``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from schemas.ids import ID_PATTERN, PROMPT_ID_MAX_LEN

KNOWN_FIELDS = ("prompt_id", "text", "answer", "metadata")

_JSON_TYPE_NAMES = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object",
                    type(None): "null"}


class PromptFileError(ValueError):
    """A prompt file is malformed; the message names the file, the line and the field."""


@dataclass(frozen=True)
class PromptRow:
    """One valid prompt of a file; ``line`` is its 1-based line (JSON lines) or row (Parquet) number."""

    prompt_id: str
    text: str
    answer: str | None
    metadata: dict[str, str]
    line: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Problem:
    """Something wrong in a prompt file. ``line`` 0 means the file as a whole; ``field`` may be None."""

    line: int
    field: str | None
    message: str
    severity: str = "error"  # "error" (the file is invalid) or "warning" (reported, the file stays valid)

    def render(self, path: object, unit: str = "line") -> str:
        """``path:LINE: field 'f': message`` for JSON lines, ``path: row N: ...`` for Parquet."""
        if self.line == 0:
            where = f"{path}"
        elif unit == "line":
            where = f"{path}:{self.line}"
        else:
            where = f"{path}: {unit} {self.line}"
        subject = f" field {self.field!r}:" if self.field else ""
        tag = "" if self.severity == "error" else f" {self.severity}:"
        return f"{where}:{tag}{subject} {self.message}"

    def to_dict(self) -> dict:
        return {"line": self.line, "field": self.field, "message": self.message, "severity": self.severity}


def type_name(value: object) -> str:
    """JSON's name for the type of ``value`` (``string``, ``integer``, ...), else the Python class name."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def unknown_fields(record: dict) -> list[str]:
    """The keys of ``record`` outside :data:`KNOWN_FIELDS`, in record order."""
    return [str(key) for key in record if key not in KNOWN_FIELDS]


def row_from_record(record: object, line: int, default_id: str) -> tuple[PromptRow | None, list[Problem]]:
    """The prompt in ``record`` (``default_id`` when it has no ``prompt_id``), or every problem found in it."""
    if not isinstance(record, dict):
        return None, [Problem(line, None, f"expected an object, got {type_name(record)}")]
    problems: list[Problem] = []
    text = _text(record.get("text"), line, problems)
    prompt_id = _prompt_id(record.get("prompt_id"), line, default_id, problems)
    answer = _answer(record.get("answer"), line, problems)
    metadata = _metadata(record.get("metadata"), line, problems)
    if problems:
        return None, problems
    return PromptRow(prompt_id, text, answer, metadata, line), []


def _text(value: object, line: int, problems: list[Problem]) -> str:
    if value is None:
        problems.append(Problem(line, "text", "missing (every prompt needs a non-empty string)"))
    elif not isinstance(value, str):
        problems.append(Problem(line, "text", f"expected a string, got {type_name(value)}"))
    elif not value.strip():
        problems.append(Problem(line, "text", "empty or whitespace only"))
    else:
        return value
    return ""


def _prompt_id(value: object, line: int, default_id: str, problems: list[Problem]) -> str:
    if value is None:
        return default_id
    if not isinstance(value, str):
        problems.append(Problem(line, "prompt_id", f"expected a string, got {type_name(value)}"))
        return default_id
    if len(value) > PROMPT_ID_MAX_LEN:
        problems.append(Problem(line, "prompt_id", f"longer than {PROMPT_ID_MAX_LEN} characters ({len(value)})"))
    elif not ID_PATTERN.fullmatch(value):
        problems.append(Problem(line, "prompt_id", f"{value[:60]!r} is not a valid id "
                                f"(must match {ID_PATTERN.pattern})"))
    return value


def _answer(value: object, line: int, problems: list[Problem]) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    problems.append(Problem(line, "answer", f"expected a string, an integer or null, got {type_name(value)}"))
    return None


def _metadata(value: object, line: int, problems: list[Problem]) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(Problem(line, "metadata", f"expected an object of strings, got {type_name(value)}"))
        return {}
    bad = [(key, item) for key, item in value.items() if not isinstance(key, str) or not isinstance(item, str)]
    if bad:
        key, item = bad[0]
        what = f"key {key[:60]!r}: expected a string value, got {type_name(item)}" if isinstance(key, str) \
            else f"expected string keys, got {type_name(key)}"
        more = f" ({len(bad)} bad entries)" if len(bad) > 1 else ""
        problems.append(Problem(line, "metadata", f"must map strings to strings; {what}{more}"))
        return {}
    return dict(value)
