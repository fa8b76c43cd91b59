"""Tool calls through the gateway on real chat templates other than Qwen's (tests/support/templates, verbatim):
Mistral-Nemo-Instruct-2407 (``[TOOL_CALLS]``, 9-character call ids the template enforces) and DeepSeek-R1-Distill
(tool calls written only for a ``null`` content, arguments concatenated as text). Checked against exact values: the
format read from each template, each sampled answer's OpenAI tool calls, the agent's next call rendered by the
template as the model wrote it (a prefix chain) or, where the template writes what the model did not sample, a
chain break that trains the turns separately; and the two silent losses the DeepSeek template caused before (a
tool call dropped for an empty content, a ``TypeError`` for object arguments)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.chat import TEMPLATE_SPECS, build_template_tokenizer

from producers.gateway.calls import chat_answer, read_request
from producers.gateway.episodes import chain_breaks
from producers.gateway.service import tool_format_of
from producers.gateway.tool_formats import detect, mistral_id, parse
from schemas import GatewayCall
from stream_rl.prompts.render import ChatRenderer, RenderError

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "add two numbers",
                                           "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "2+3?"}]
USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _call(index: int, prompt: list[int], response: list[int]) -> GatewayCall:
    return GatewayCall(episode_id="e/0", call_index=index, endpoint="chat", messages_json="[]",
                       prompt_token_ids=np.array(prompt, np.int32), response_token_ids=np.array(response, np.int32),
                       behavior_logprobs=np.full(len(response), -0.5, np.float32),
                       token_policy_versions=np.zeros(len(response), np.int64), finish_reason="stop",
                       temperature=1.0, response_text="x", created_at=1.0)


def _answer(tok, sampled: str, call_id: str = "chatcmpl-e/0-0") -> dict:
    """The gateway's answer to a sampled text (decoded both ways, as the service decodes it)."""
    ids = _ids(tok, sampled)
    fmt = tool_format_of("auto", None, tok)
    return chat_answer(call_id, "m", tok.decode(ids, skip_special_tokens=True), "stop", USAGE, True, fmt,
                       tok.decode(ids, skip_special_tokens=False), tok.all_special_tokens)["choices"][0]


def _next_prompt(tok, message: dict, result: str = "5") -> list[int]:
    """The agent's second call: its history, the assistant message as answered and the tool's result, rendered."""
    calls = message["tool_calls"]
    tool = {"role": "tool", "tool_call_id": calls[0]["id"], "content": result}
    sent = read_request({"model": "m", "tools": TOOLS, "messages": [*USER, message, tool]}, "chat", "m", 64)
    return ChatRenderer(tok, None).render(sent.messages, sent.tools)[1]


def test_the_format_is_read_off_each_real_template():
    assert detect(TEMPLATE_SPECS["mistral-nemo"].template) == "mistral"
    for name in ("qwen2.5", "deepseek-r1-distill", "phi-4", "llama-3.1-like"):
        assert detect(TEMPLATE_SPECS[name].template) == "hermes", name
    assert tool_format_of("hermes", None, build_template_tokenizer("mistral-nemo")) == "hermes"  # the setting wins


@pytest.fixture(scope="module")
def nemo():
    return build_template_tokenizer("mistral-nemo")


def test_a_mistral_call_with_its_sampled_id_is_answered_and_rendered_back_as_sampled(nemo):
    _, p0 = ChatRenderer(nemo, None).render(USER, TOOLS)
    assert nemo.decode(p0) == ('<s>[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "calc", "description": '
                               '"add two numbers", "parameters": {"type": "object"}}}][/AVAILABLE_TOOLS][INST]2+3?'
                               '[/INST]')
    sampled = '[TOOL_CALLS][{"name": "calc", "arguments": {"a": 2, "b": 3}, "id": "c4lc0000a"}]</s>'
    choice = _answer(nemo, sampled)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": "c4lc0000a", "type": "function", "function": {
        "name": "calc", "arguments": json.dumps({"a": 2, "b": 3})}}]
    s0 = _ids(nemo, sampled)
    p1 = _next_prompt(nemo, choice["message"])
    assert nemo.decode(p1[len(p0) + len(s0):]) == '[TOOL_RESULTS]{"content": 5, "call_id": "c4lc0000a"}[/TOOL_RESULTS]'
    assert chain_breaks([_call(0, p0, s0), _call(1, p1, _ids(nemo, "5</s>"))]) == []  # one multi-turn rollout


def test_a_mistral_call_without_an_id_gets_one_the_template_accepts_and_is_trained_as_separate_turns(nemo):
    _, p0 = ChatRenderer(nemo, None).render(USER, TOOLS)
    sampled = 'Adding. [TOOL_CALLS] [{"name": "calc", "arguments": {"a": 2, "b": 3}}]</s>'
    choice = _answer(nemo, sampled)
    (call,) = choice["message"]["tool_calls"]
    assert choice["message"]["content"] == "Adding." and call["id"] == mistral_id("chatcmpl-e/0-0", 0)
    assert len(call["id"]) == 9 and call["id"].isalnum()
    p1 = _next_prompt(nemo, choice["message"])  # renders: the id has the shape the template demands
    assert f'"id": "{call["id"]}"' in nemo.decode(p1)
    assert chain_breaks([_call(0, p0, _ids(nemo, sampled)), _call(1, p1, _ids(nemo, "5</s>"))])  # id written in
    hermes_id = {**choice["message"], "tool_calls": [{**call, "id": "chatcmpl-e/0-0-0"}]}
    with pytest.raises(Exception, match="Tool call IDs should be alphanumeric strings with length 9"):
        _next_prompt(nemo, hermes_id)  # why the id must have that shape: the template refuses any other


@pytest.mark.parametrize("sampled", [
    '[TOOL_CALLS][{"name": "calc", "arguments": "2+3"}]</s>',  # arguments not an object
    '[TOOL_CALLS][{"arguments": {"a": 1}}]</s>',  # no name
    '[TOOL_CALLS][{"name": "calc", "arguments": {"a": 1}</s>',  # cut off
    '[TOOL_CALLS]</s>',
    'the answer is 5</s>',
])
def test_a_mistral_answer_that_is_not_a_whole_call_is_plain_content(nemo, sampled):
    ids = _ids(nemo, sampled)
    text = nemo.decode(ids, skip_special_tokens=True)
    assert parse("mistral", nemo.decode(ids), text, "c", nemo.all_special_tokens) == (text, [])


def test_hermes_calls_keep_their_meaning_on_the_qwen_template():
    qwen = build_template_tokenizer("qwen2.5")
    choice = _answer(qwen, 'Sure.<tool_call>\n{"name": "calc", "arguments": {"a": 2}}\n</tool_call><|im_end|>')
    assert choice["message"] == {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "chatcmpl-e/0-0-0", "type": "function", "function": {"name": "calc", "arguments": '{"a": 2}'}}]}
    bad = _answer(qwen, '<tool_call>\n{"name": "calc", "arguments": [1]}\n</tool_call><|im_end|>')
    assert bad["finish_reason"] == "stop" and "tool_calls" not in bad["message"]  # arguments must be an object


def test_the_deepseek_template_renders_an_agents_tool_call_with_a_null_content_and_text_arguments():
    """DeepSeek-R1-Distill's template writes a tool call only when the content is ``null`` and concatenates its
    arguments as text: the gateway keeps the ``null`` and the renderer hands the template the JSON text (before:
    the content became "" and the call vanished from the prompt, or the object arguments raised TypeError)."""
    tok = build_template_tokenizer("deepseek-r1-distill")
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "calc", "arguments": '{"a": 2, "b": 3}'}}]}
    sent = read_request({"model": "m", "messages": [*USER, message, {"role": "tool", "content": "5"}]},
                        "chat", "m", 64)
    assert sent.messages[1]["content"] is None and sent.messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "a": 2, "b": 3}
    text, ids = ChatRenderer(tok, None).render(sent.messages)
    bar, space = "\uff5c", "\u2581"
    assert (f"<{bar}Assistant{bar}><{bar}tool{space}calls{space}begin{bar}><{bar}tool{space}call{space}begin{bar}>"
            f'function<{bar}tool{space}sep{bar}>calc\n```json\n{{"a": 2, "b": 3}}\n```'
            f"<{bar}tool{space}call{space}end{bar}>") in text
    assert tok.decode(ids) == text
    with pytest.raises(RenderError, match="TypeError"):  # a template error that text arguments do not mend
        ChatRenderer(tok, "{{ messages[0]['content'] + 1 }}{# reads tool_calls #}").render(sent.messages)


def test_a_call_sent_back_arguments_first_is_rendered_name_first(nemo):
    """The ``openai`` client's ``model_dump`` puts ``arguments`` before ``name``; Mistral's template writes the whole
    function with ``tojson``, so the gateway restores the order the model sampled (name, then arguments)."""
    message = {"role": "assistant", "tool_calls": [{"id": "c4lc0000a", "type": "function", "function": {
        "arguments": '{"a": 2, "b": 3}', "name": "calc"}}]}
    sent = read_request({"model": "m", "messages": [*USER, message]}, "chat", "m", 64)
    assert list(sent.messages[1]["tool_calls"][0]["function"]) == ["name", "arguments"]
    assert '[TOOL_CALLS][{"name": "calc", "arguments": {"a": 2, "b": 3}, "id": "c4lc0000a"}]</s>' in nemo.decode(
        ChatRenderer(nemo, None).render(sent.messages, TOOLS)[1])
