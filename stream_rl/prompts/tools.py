"""Tool use in prompt files: the ``tool_calls`` of an assistant message and a prompt's ``tools`` column.

Consumes: decoded values of one record (JSON lines, Parquet, a ``datasets`` directory) with their line and field.
Produces: the values the chat template gets, as ``transformers``' ``apply_chat_template(messages, tools=tools)``
takes them (OpenAI's format, which the datasets of tool-use RL carry):

- ``tool_calls``: a non-empty list of ``{"type": "function", "function": {"name": str, "arguments": {...}}}``
  (``type`` may be left out; an ``id`` string is kept). ``arguments`` given as a JSON string of an object (OpenAI's
  wire form) is parsed into that object, since templates write it with ``| tojson`` (a string would be quoted);
- ``tools``: a non-empty list of JSON-schema function specs (``{"type": "function", "function": {"name": ...,
  "parameters": {...}}}`` or a bare ``{"name": ..., "parameters": {...}}``), or a JSON string of such a list.

Guarantees: every problem names the line and the field (``messages.2.tool_calls.0.function.name``), quoting
field names and types, never values. Parquet turns a list of objects into a struct column holding every key of
every row (absent ones null), so write ``tools`` and ``arguments`` as JSON strings there (docs/prompts.md).
"""

from __future__ import annotations

import json

from stream_rl.prompts.schema import Problem, type_name


def tool_calls(value: object, line: int, problems: list[Problem], where: str) -> list[dict] | None:
    """The checked tool calls of one assistant message (module docstring), or None with problems."""
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else type_name(value)
        problems.append(Problem(line, where, f"expected a non-empty list of tool calls, got {what}"))
        return None
    before = len(problems)
    calls = [_call(item, line, problems, f"{where}.{index}") for index, item in enumerate(value)]
    return calls if len(problems) == before else None


def _call(item: object, line: int, problems: list[Problem], where: str) -> dict:
    if not isinstance(item, dict) or not isinstance(item.get("function"), dict):
        problems.append(Problem(line, f"{where}.function", "expected {type: 'function', function: {name, "
                                "arguments}} (OpenAI's format)"))
        return {}
    kind, function = item.get("type"), item["function"]
    if kind not in (None, "function"):
        problems.append(Problem(line, f"{where}.type", f"expected 'function', got {type_name(kind)}"))
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        problems.append(Problem(line, f"{where}.function.name", "expected a non-empty string"))
    arguments = _object(function.get("arguments"), line, problems, f"{where}.function.arguments")
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(item.get("id"), str):
        call["id"] = item["id"]
    return call


def tools(value: object, line: int, problems: list[Problem], name: str = "tools") -> list[dict] | None:
    """The checked tool specs of one prompt (module docstring); None when absent or with problems."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            problems.append(Problem(line, name, f"a string that is not JSON ({exc.msg} at column {exc.colno})"))
            return None
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else type_name(value)
        problems.append(Problem(line, name, f"expected a non-empty list of function specs, got {what}"))
        return None
    for index, spec in enumerate(value):
        function = spec.get("function", spec) if isinstance(spec, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            problems.append(Problem(line, f"{name}.{index}", "expected a function spec with a name ({type: "
                                    "'function', function: {name, description, parameters}})"))
    return value


def _object(value: object, line: int, problems: list[Problem], where: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            problems.append(Problem(line, where, f"a string that is not JSON ({exc.msg} at column {exc.colno})"))
            return {}
    if not isinstance(value, dict):
        problems.append(Problem(line, where, f"expected an object or a JSON string of one, got {type_name(value)}"))
        return {}
    return value
