"""Streamed answers of the gateway: a whole OpenAI answer re-cut as the server-sent events of ``stream: true``.

Consumes: a request body's ``stream`` and ``stream_options`` (:func:`stream_mode`), and the whole answer object the
gateway built (:func:`producers.gateway.calls.chat_answer` or :func:`~producers.gateway.calls.completion_answer`)
after the call was sampled and recorded.
Produces: the chunk objects OpenAI streams (:func:`chunks`: ``chat.completion.chunk`` or ``text_completion``
chunks) and the bytes of the event stream (:func:`event_stream`: ``data: {chunk}`` events, then
``data: [DONE]``).

Guarantees:
- A streamed call is sampled and recorded exactly as a whole one: the call is on the gateway topic before the
  first byte of its stream is sent, so streaming changes only how the answer is cut, never what is recorded.
- The stream holds one content delta (the whole text: the gateway samples the answer before answering, so there
  are no earlier tokens to send), the tool calls as OpenAI's indexed ``tool_calls`` deltas, one chunk with the
  finish reason, and, with ``stream_options.include_usage``, a last chunk with empty ``choices`` and the usage
  (every earlier chunk then carries ``usage: null``), as OpenAI sends them; joined by a client, the deltas give
  back the whole answer's message exactly.
- A malformed ``stream`` or ``stream_options`` is refused before anything is sampled
  (:class:`~producers.gateway.calls.RequestError` naming the field).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from producers.gateway.calls import RequestError


def stream_mode(body: Any) -> tuple[bool, bool]:
    """``(stream, include_usage)`` of a request body; RequestError when either is not a boolean."""
    if not isinstance(body, dict):
        return False, False
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    if not stream:
        raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise RequestError(f"stream_options.include_usage must be true or false, got {usage!r}",
                           param="stream_options")
    return True, usage


def chunks(answer: Mapping[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """The chunks streaming ``answer`` (a ``chat.completion`` or ``text_completion`` object)."""
    choice = answer["choices"][0]
    chat = answer["object"] == "chat.completion"
    head = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"]}
    if include_usage:
        head["usage"] = None
    if chat:
        bodies = [{"delta": _delta(choice["message"]), "finish_reason": None},
                  {"delta": {}, "finish_reason": choice["finish_reason"]}]
    else:
        bodies = [{"text": choice["text"], "finish_reason": None},
                  {"text": "", "finish_reason": choice["finish_reason"]}]
    out = [{**head, "choices": [{"index": 0, **body, "logprobs": None}]} for body in bodies]
    if include_usage:
        out.append({**head, "choices": [], "usage": dict(answer["usage"])})
    return out


def _delta(message: Mapping[str, Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    calls = message.get("tool_calls")
    if calls:
        delta["tool_calls"] = [{"index": i, "id": call["id"], "type": call.get("type", "function"),
                                "function": {"name": call["function"]["name"],
                                             "arguments": call["function"]["arguments"]}}
                               for i, call in enumerate(calls)]
    return delta


def event_stream(answer: Mapping[str, Any], include_usage: bool) -> bytes:
    """The server-sent events of ``answer``: one ``data:`` event per chunk, then ``data: [DONE]``."""
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks(answer, include_usage)]
    return ("".join(events) + "data: [DONE]\n\n").encode()
