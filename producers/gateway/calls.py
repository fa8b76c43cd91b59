"""The OpenAI wire of the gateway: requests read and checked, answers and errors shaped as the OpenAI API shapes them.

Consumes: a decoded JSON request body of ``/v1/chat/completions`` or ``/v1/completions`` (its ``stream`` fields are
:mod:`producers.gateway.streaming`'s), the model name agents must send and the token budget
(``producer.max_new_tokens``); a sampled text to answer with.
Produces: :class:`CallRequest` (messages normalised for the chat template, tools, token budget, temperature), the
answer bodies (:func:`chat_answer`, :func:`completion_answer`) and :class:`RequestError`, whose
:meth:`~RequestError.body` is OpenAI's error object.

Guarantees:
- A request the gateway cannot serve faithfully is refused with a message naming what is wrong, never served
  differently from what it asked: an unknown model (404), ``n`` other than 1, ``max_tokens`` above the budget, a
  temperature of 0 (greedy decoding has no behaviour logprobs to train with), malformed ``messages`` or ``tools``
  (400, the message index named).
- Messages are passed to the chat template as the agent sent them except for two normalisations the OpenAI
  format needs: a ``null`` or list-of-parts ``content`` becomes its text (an assistant message with tool calls
  keeps a ``null`` content: templates such as DeepSeek's write its calls only then), and a tool call's
  ``arguments`` JSON string becomes the object templates expect (``tool_call.arguments | tojson``; a template that
  concatenates it as text gets the text back: :class:`stream_rl.prompts.render.ChatRenderer`), written after the
  function's ``name`` whatever order the agent sent them in (the ``openai`` client sends ``arguments`` first, and
  Mistral's template writes the whole function with ``tojson``).
- Tool calls are read from the sampled text in the format of the chat template (``gateway.tool_format``: Hermes /
  Qwen ``<tool_call>`` blocks or Mistral ``[TOOL_CALLS]``; :mod:`producers.gateway.tool_formats`); text that is
  not a call stays the answer's ``content``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the gateway refuses: HTTP ``status``, OpenAI's error ``code`` and the field at fault."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CallRequest:
    """One checked request: ``messages`` (chat) or ``prompt`` (completion), as sent and as rendered."""

    endpoint: str  # "chat" or "completion"
    sent: Any  # the request's messages (chat) or prompt (completion), exactly as sent
    max_tokens: int
    temperature: float | None  # None: the producer's
    messages: list[dict[str, Any]] = field(default_factory=list)  # normalised for the chat template
    tools: list[dict[str, Any]] | None = None
    prompt: str = ""


def read_request(body: Any, endpoint: str, model_name: str, budget: int) -> CallRequest:
    """The checked request of ``endpoint`` (``chat`` or ``completion``), or :class:`RequestError`."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model != model_name:
        raise RequestError(f"unknown model {model!r}: this gateway serves the policy as {model_name!r}",
                           status=404, code="model_not_found", param="model")
    if body.get("n", 1) != 1:
        raise RequestError(f"n={body.get('n')!r}: the gateway samples one choice per call", param="n")
    max_tokens = _max_tokens(body, budget)
    temperature = _temperature(body.get("temperature"))
    if endpoint == "completion":
        return CallRequest("completion", body.get("prompt"), max_tokens, temperature, prompt=_prompt(body))
    messages, tools = body.get("messages"), body.get("tools")
    return CallRequest("chat", messages, max_tokens, temperature, messages=_messages(messages), tools=_tools(tools))


def _max_tokens(body: Mapping[str, Any], budget: int) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return budget
    if type(value) is not int or value < 1:
        raise RequestError(f"{name} must be a positive integer, got {value!r}", param=name)
    if value > budget:
        raise RequestError(f"too many tokens: {name}={value} is above the gateway's budget of {budget} "
                           f"(producer.max_new_tokens)", param=name, code="too_many_tokens")
    return value


def _temperature(value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 100:
        raise RequestError(f"temperature must be in (0, 100], got {value!r} (greedy decoding is not served: the "
                           f"trainer needs the sampling distribution's logprobs)", param="temperature")
    return float(value)


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt must be one non-empty string", param="prompt")
    return prompt


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of messages", param="messages")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, message: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise RequestError(f"{where} must be an object whose role is one of {', '.join(ROLES)}", param=where)
    out = dict(message)
    calls_only = message.get("content") is None and message.get("tool_calls") is not None
    out["content"] = None if calls_only else _content(where, message.get("content"))
    if message.get("tool_calls") is not None:
        out["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", call)
                             for j, call in enumerate(_list(where + ".tool_calls", message["tool_calls"]))]
    return out


def _content(where: str, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"{where}.content must be a string, null or a list of text parts", param=where)


def _list(where: str, value: Any) -> list:
    if not isinstance(value, list):
        raise RequestError(f"{where} must be a list", param=where)
    return value


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"{where} must hold a function with a name", param=where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise RequestError(f"{where}.function.arguments is not JSON", param=where) from None
    # name first, then arguments: the openai client sends them the other way round, and a template that writes the
    # whole function with `tojson` (Mistral's) would write back a call the model never sampled
    rest = {key: value for key, value in function.items() if key not in ("name", "arguments")}
    return {**call, "function": {"name": function["name"], "arguments": arguments, **rest}}


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    for j, tool in enumerate(_list("tools", tools)):
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise RequestError(f"tools[{j}] must be an object with a function", param=f"tools[{j}]")
    return list(tools)


def parse_tool_calls(text: str, call_id: str, fmt: str = "hermes", raw: str | None = None,
                     specials: Sequence[str] = ()) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a sampled text in the tool-call format ``fmt``
    (:mod:`producers.gateway.tool_formats`); ``raw`` is the text with its special tokens (default ``text``)."""
    from producers.gateway.tool_formats import parse

    return parse(fmt, text if raw is None else raw, text, call_id, specials)


def chat_answer(call_id: str, model: str, text: str, finish_reason: str, usage: Mapping[str, int],
                with_tools: bool, fmt: str = "hermes", raw: str | None = None,
                specials: Sequence[str] = ()) -> dict[str, Any]:
    """The ``chat.completion`` object of one sampled text (``raw``: with its special tokens, for ``fmt``)."""
    content, tool_calls = parse_tool_calls(text, call_id, fmt, raw, specials) if with_tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    reason = "tool_calls" if tool_calls else finish_reason
    return {"id": call_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
            "usage": dict(usage)}


def completion_answer(call_id: str, model: str, text: str, finish_reason: str,
                      usage: Mapping[str, int]) -> dict[str, Any]:
    """The ``text_completion`` object of one sampled text."""
    return {"id": call_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
            "usage": dict(usage)}


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
