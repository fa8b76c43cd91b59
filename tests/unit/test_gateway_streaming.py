"""Streamed gateway answers (producers.gateway.streaming): the chunks of a whole answer join back to it exactly, in
the shapes OpenAI streams (read back with the ``openai`` client's own chunk types), and malformed stream fields are
refused naming the field."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionChunk
from openai.types.completion import Completion

from producers.gateway.calls import RequestError, chat_answer, completion_answer, usage_of
from producers.gateway.streaming import chunks, event_stream, stream_mode

USAGE = usage_of(7, 3)
CALL = '<tool_call>\n{"name": "calc", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _events(data: bytes) -> list:
    text = data.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_chat_answer_streams_as_chunks_that_join_to_its_message(include_usage):
    answer = chat_answer("chatcmpl-e-0", "policy", "Hello there", "length", USAGE, with_tools=False)
    events = _events(event_stream(answer, include_usage))
    parsed = [ChatCompletionChunk.model_validate(e) for e in events]  # the openai client's own type
    assert len(parsed) == (3 if include_usage else 2)
    assert all(p.id == "chatcmpl-e-0" and p.model == "policy" for p in parsed)
    assert "".join(p.choices[0].delta.content or "" for p in parsed if p.choices) == "Hello there"
    assert parsed[0].choices[0].delta.role == "assistant" and parsed[0].choices[0].finish_reason is None
    assert parsed[1].choices[0].finish_reason == "length"
    if include_usage:  # every chunk but the last carries usage null; the last has no choices
        assert [e["usage"] for e in events[:-1]] == [None, None]
        assert parsed[-1].choices == [] and parsed[-1].usage.model_dump() == {
            **USAGE, "completion_tokens_details": None, "prompt_tokens_details": None}
    else:
        assert all("usage" not in e for e in events)


def test_tool_calls_stream_as_indexed_deltas_with_their_ids_and_json_arguments():
    answer = chat_answer("chatcmpl-e-1", "policy", CALL + CALL, "stop", USAGE, with_tools=True)
    (first, last) = [ChatCompletionChunk.model_validate(c) for c in chunks(answer, False)]
    calls = first.choices[0].delta.tool_calls
    assert [c.index for c in calls] == [0, 1] and first.choices[0].delta.content is None
    whole = answer["choices"][0]["message"]["tool_calls"]
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in calls] == [
        (w["id"], "function", "calc", w["function"]["arguments"]) for w in whole]
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
    assert last.choices[0].finish_reason == "tool_calls" and last.choices[0].delta.tool_calls is None


def test_a_completion_streams_as_text_completion_chunks():
    answer = completion_answer("cmpl-e-2", "policy", "5 and more", "stop", USAGE)
    events = _events(event_stream(answer, True))  # OpenAI's chunks have finish_reason null until the last
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "5 and more"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]] == [None, "stop"]
    assert {e["object"] for e in events} == {"text_completion"}
    assert Completion.model_validate(events[-1]).usage.total_tokens == 10 and events[-1]["choices"] == []


@pytest.mark.parametrize(("body", "mode"), [
    ({}, (False, False)), ({"stream": False}, (False, False)), ({"stream": None}, (False, False)),
    ({"stream": True}, (True, False)), ({"stream": True, "stream_options": {"include_usage": True}}, (True, True)),
    ({"stream": True, "stream_options": {}}, (True, False)), (None, (False, False)),
])
def test_stream_mode_reads_the_request(body, mode):
    assert stream_mode(body) == mode


@pytest.mark.parametrize(("body", "words"), [
    ({"stream": "true"}, "stream must be true or false, got 'true'"),
    ({"stream": 1}, "stream must be true or false"),
    ({"stream": True, "stream_options": []}, "stream_options must be an object"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "only allowed with stream=true"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage must be true or false"),
])
def test_malformed_stream_fields_are_refused_naming_the_field(body, words):
    with pytest.raises(RequestError) as caught:
        stream_mode(body)
    assert words in str(caught.value) and caught.value.status == 400
    assert caught.value.param in ("stream", "stream_options")
