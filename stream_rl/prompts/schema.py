"""The prompt-file schema: one decoded record checked field by field.

Consumes: one record as decoded from a JSON line or a Parquet row, with its 1-based line (or row) number.
Produces: a :class:`PromptRow`, or the :class:`Problem` list saying why the record is not one.

Schema (the reference table is in ``docs/prompts.md``):

=============  =========================================================  ========================================
field          accepted values                                            when absent or null
=============  =========================================================  ========================================
``text``       a string with at least one non-whitespace character        error unless ``messages`` is set
``messages``   a non-empty list of ``{role, content}`` objects (below)     error unless ``text`` is set
``prompt_id``  a string matching ``schemas.ID_PATTERN``, <= 200 chars     ``line{N}`` (JSON lines) / ``row{N}``
``answer``     a string, or an integer (published as its decimal form)   ``None``
``metadata``   an object (Parquet: map or struct) of string -> string    ``{}``
``tools``      a list of function specs, or a JSON string of one          no tools
=============  =========================================================  ========================================

A record has ``text`` XOR ``messages``. A message is an object with ``role`` (one of :data:`ROLES`) and ``content``
(a string with a non-whitespace character), optionally ``name`` / ``tool_call_id`` (strings) and, for an assistant,
``tool_calls`` in OpenAI's format (then ``content`` may be empty, null or absent: absent becomes null, OpenAI's
form, which DeepSeek's templates need to write the calls); null members are ignored (a Parquet
struct carries every key of every row). ``tool_calls`` and ``tools`` are checked and normalised by
:mod:`stream_rl.prompts.tools`; ``tools`` goes with a conversational prompt to its chat template. A message's
problem names its field as ``messages.I.key`` (``I`` 0-based), under the column it came from (``prompt.1.role`` for
verl / TRL files).

Guarantees: every problem carries the line and the field; a message quotes ids, field names and type names but
never a prompt or answer value, so reports and logs stay free of sample text. Fields outside the table are
reported by :func:`unknown_fields` and left to the caller (a warning by default, an error with ``strict``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from schemas.ids import ID_PATTERN, PROMPT_ID_MAX_LEN

KNOWN_FIELDS = ("prompt_id", "text", "messages", "answer", "metadata", "tools")
ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (OpenAI's chat format)."""
OPTIONAL_MESSAGE_KEYS = ("name", "tool_call_id")

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
    messages: list[dict] | None = None  # a conversational prompt: ``text`` is its rendering, once rendered
    prompt_token_ids: tuple[int, ...] | None = None  # the rendered prompt's ids (conversational prompts only)
    prompt_field: str = field(default="text", compare=False)  # the column the prompt came from, for problems
    tools: list[dict] | None = None  # function specs the chat template renders with the messages

    @property
    def conversational(self) -> bool:
        return self.messages is not None


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


def row_from_record(record: object, line: int, default_id: str,
                    names: dict[str, str] | None = None) -> tuple[PromptRow | None, list[Problem]]:
    """The prompt in ``record`` (``default_id`` when it has no ``prompt_id``), or every problem found in it.

    ``names`` maps a field of the table above to the column it was read from (e.g. ``answer`` ->
    ``reward_model.ground_truth``), so a problem names the user's column; absent: the field's own name.
    """
    if not isinstance(record, dict):
        return None, [Problem(line, None, f"expected an object, got {type_name(record)}")]
    names = names or {}
    problems: list[Problem] = []
    text, messages = _prompt(record, line, names, problems)
    prompt_id = _prompt_id(record.get("prompt_id"), line, default_id, problems, names.get("prompt_id", "prompt_id"))
    answer = _answer(record.get("answer"), line, problems, names.get("answer", "answer"))
    metadata = _metadata(record.get("metadata"), line, problems)
    tools = _tools(record.get("tools"), record.get("messages") is not None, line, problems,
                   names.get("tools", "tools"))
    if problems:
        return None, problems
    source = names.get("messages" if messages is not None else "text",
                       "messages" if messages is not None else "text")
    return PromptRow(prompt_id, text, answer, metadata, line, messages=messages, prompt_field=source,
                     tools=tools), []


def _tools(value: object, conversational: bool, line: int, problems: list[Problem], name: str) -> list[dict] | None:
    if value is None:
        return None
    if not conversational:
        problems.append(Problem(line, name, "tools go with a conversational prompt (messages): a text prompt is "
                                "given to the policy as it is"))
        return None
    from stream_rl.prompts.tools import tools  # it builds on this module's Problem

    return tools(value, line, problems, name)


def _prompt(record: dict, line: int, names: dict[str, str],
            problems: list[Problem]) -> tuple[str, list[dict[str, str]] | None]:
    """``(text, None)`` for a text prompt, ``("", messages)`` for a conversational one (rendered later)."""
    text_name, messages_name = names.get("text", "text"), names.get("messages", "messages")
    if record.get("messages") is None:
        return _text(record.get("text"), line, problems, text_name), None
    if record.get("text") is not None:
        problems.append(Problem(line, text_name, f"both {text_name} and {messages_name} are set (a prompt is one "
                                "or the other)"))
        return "", None
    return "", _messages(record["messages"], line, problems, messages_name)


def _messages(value: object, line: int, problems: list[Problem], name: str) -> list[dict[str, str]] | None:
    if not isinstance(value, list):
        problems.append(Problem(line, name, f"expected a list of messages, got {type_name(value)}"))
        return None
    if not value:
        problems.append(Problem(line, name, "empty list of messages"))
        return None
    before = len(problems)
    out = [_message(item, line, problems, f"{name}.{index}") for index, item in enumerate(value)]
    return out if len(problems) == before else None


def _message(item: object, line: int, problems: list[Problem], where: str) -> dict:
    if not isinstance(item, dict):
        problems.append(Problem(line, where, f"expected an object with role and content, got {type_name(item)}"))
        return {}
    role = item.get("role")
    if role is None:
        problems.append(Problem(line, f"{where}.role", f"missing (one of {', '.join(ROLES)})"))
    elif not isinstance(role, str) or role not in ROLES:
        shown = f"{role[:40]!r}" if isinstance(role, str) else type_name(role)
        problems.append(Problem(line, f"{where}.role", f"unknown role {shown} (expected one of {', '.join(ROLES)})"))
    calls = _tool_calls(item, role, line, problems, where)
    out = {"role": role, **_content(item.get("content"), item.get("tool_calls") is not None, line, problems, where)}
    if calls is not None:
        out["tool_calls"] = calls
    for key, extra in item.items():
        if key in ("role", "content", "tool_calls") or extra is None:
            continue
        if key not in OPTIONAL_MESSAGE_KEYS:
            problems.append(Problem(line, f"{where}.{key}", f"unknown key (allowed: role, content, tool_calls, "
                                    f"{', '.join(OPTIONAL_MESSAGE_KEYS)})"))
        elif not isinstance(extra, str):
            problems.append(Problem(line, f"{where}.{key}", f"expected a string, got {type_name(extra)}"))
        else:
            out[key] = extra
    return out


def _content(content: object, calls: bool, line: int, problems: list[Problem], where: str) -> dict:
    """``{"content": ...}``; an assistant turn with tool calls may have none (left out) or an empty one."""
    if content is None and calls:
        return {"content": None}  # OpenAI's null: templates test `content is none` (DeepSeek writes the calls then)
    if content is None:
        problems.append(Problem(line, f"{where}.content", "missing (every message needs a non-empty string)"))
    elif not isinstance(content, str):
        problems.append(Problem(line, f"{where}.content", f"expected a string, got {type_name(content)}"))
    elif not content.strip() and not calls:
        problems.append(Problem(line, f"{where}.content", "empty or whitespace only"))
    return {"content": content}


def _tool_calls(item: dict, role: object, line: int, problems: list[Problem], where: str) -> list[dict] | None:
    """The message's checked ``tool_calls`` (:mod:`stream_rl.prompts.tools`); only an assistant makes them."""
    value = item.get("tool_calls")
    if value is None:
        return None
    if role != "assistant":
        problems.append(Problem(line, f"{where}.tool_calls", "only an assistant message has tool calls"))
        return None
    from stream_rl.prompts.tools import tool_calls  # it builds on this module's Problem

    return tool_calls(value, line, problems, f"{where}.tool_calls")


def _text(value: object, line: int, problems: list[Problem], name: str = "text") -> str:
    if value is None:
        problems.append(Problem(line, name, "missing (every prompt needs a non-empty string text, or messages)"))
    elif not isinstance(value, str):
        problems.append(Problem(line, name, f"expected a string or a list of messages, got {type_name(value)}"))
    elif not value.strip():
        problems.append(Problem(line, name, "empty or whitespace only"))
    else:
        return value
    return ""


def _prompt_id(value: object, line: int, default_id: str, problems: list[Problem], name: str = "prompt_id") -> str:
    if value is None:
        return default_id
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and name != "prompt_id":
        value = str(int(value))  # a mapped id column of integers (e.g. extra_info.index)
    if not isinstance(value, str):
        problems.append(Problem(line, name, f"expected a string, got {type_name(value)}"))
        return default_id
    if len(value) > PROMPT_ID_MAX_LEN:
        problems.append(Problem(line, name, f"longer than {PROMPT_ID_MAX_LEN} characters ({len(value)})"))
    elif not ID_PATTERN.fullmatch(value):
        problems.append(Problem(line, name, f"{value[:60]!r} is not a valid id "
                                f"(must match {ID_PATTERN.pattern})"))
    return value


def _answer(value: object, line: int, problems: list[Problem], name: str = "answer") -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    problems.append(Problem(line, name, f"expected a string, an integer or null, got {type_name(value)}"))
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
