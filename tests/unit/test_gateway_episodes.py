"""The gateway's pure parts (producers.gateway.episodes, book, calls) on a real tokenizer and a real tool-use chat
template: the prefix chain, the multi-turn rollout and its mask, the separate-turns fallback on drift, the book's
states, and the OpenAI request checks, against exact values."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.chat import TOOLS_TEMPLATE, build_chat_tokenizer

from producers.gateway.book import Book
from producers.gateway.calls import RequestError, chat_answer, parse_tool_calls, read_request
from producers.gateway.episodes import Ended, assemble_group, chain_breaks, group_of
from schemas import GatewayCall, GatewayEpisode, decode, encode
from stream_rl.prompts.render import ChatRenderer
from stream_rl.rewards.given import episode_reward

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "add two numbers",
                                           "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
FINAL = "5<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _call(episode: str, index: int, prompt: list[int], response: list[int], version: int = 0,
          t: float = 100.0) -> GatewayCall:
    return GatewayCall(episode_id=episode, call_index=index, endpoint="chat", messages_json="[]",
                       prompt_token_ids=np.array(prompt, np.int32), response_token_ids=np.array(response, np.int32),
                       behavior_logprobs=np.full(len(response), -0.5, np.float32),
                       token_policy_versions=np.full(len(response), version, np.int64), finish_reason="stop",
                       temperature=1.0, response_text="x", created_at=t)


def _end(episode: str, reward: float | None = 1.0, calls: int = 2) -> GatewayEpisode:
    return GatewayEpisode(episode_id=episode, outcome="ended", reward=reward, reason="", calls=calls)


def _tool_episode(tok, edit_history: bool = False) -> list[GatewayCall]:
    """A two-call tool-using episode as an agent plays it: the gateway renders what the agent sends."""
    renderer = ChatRenderer(tok, TOOLS_TEMPLATE)
    user = [{"role": "user", "content": "2+3?"}]
    _, p0 = renderer.render(user, TOOLS)
    s0 = _ids(tok, CALL)
    content, calls = parse_tool_calls(tok.decode(s0, skip_special_tokens=True), "c")
    assistant = {"role": "assistant", "content": "I will add." if edit_history else content, "tool_calls": calls}
    sent = read_request({"model": "m", "messages": [*user, assistant, {"role": "tool", "content": "5"}]},
                        "chat", "m", 16)
    _, p1 = renderer.render(sent.messages, TOOLS)
    return [_call("calc-1/0", 0, p0, s0, version=3), _call("calc-1/0", 1, p1, _ids(tok, FINAL), version=4)]


def test_a_tool_using_episode_forms_a_prefix_chain_on_the_real_template(tok):
    calls = _tool_episode(tok)
    assert chain_breaks(calls) == []
    p0, s0, p1 = calls[0].prompt_token_ids, calls[0].response_token_ids, calls[1].prompt_token_ids
    assert list(p1[:len(p0) + len(s0)]) == list(p0) + list(s0)


def test_the_chained_rollout_is_the_rendering_of_the_whole_conversation_with_the_policy_mask(tok):
    calls = _tool_episode(tok)
    (rollout,) = assemble_group("calc-1", [Ended("calc-1/0", calls, _end("calc-1/0", 0.75))], "gw-0",
                                lambda ids: tok.decode(list(ids)))
    p0, s0, p1, s1 = (list(x) for x in (calls[0].prompt_token_ids, calls[0].response_token_ids,
                                        calls[1].prompt_token_ids, calls[1].response_token_ids))
    gap = p1[len(p0) + len(s0):]
    assert tok.decode(gap) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert list(rollout.prompt_token_ids) == p0
    assert list(rollout.response_token_ids) == p1[len(p0):] + s1 == s0 + gap + s1
    assert list(rollout.policy_mask) == [1] * len(s0) + [0] * len(gap) + [1] * len(s1)
    assert list(rollout.behavior_logprobs) == [-0.5] * len(s0) + [0.0] * len(gap) + [-0.5] * len(s1)
    assert list(rollout.token_policy_versions) == [3] * (len(s0) + len(gap)) + [4] * len(s1)
    assert rollout.turns == [{"role": "policy", "finish_reason": "stop"}, {"role": "env"},
                             {"role": "policy", "finish_reason": "stop"}]
    assert (rollout.rollout_id, rollout.group_id, rollout.group_size) == ("calc-1:0:0", "calc-1:0", 1)
    assert rollout.metadata == {"episode_id": "calc-1/0", "gateway_mode": "chain", "reward_source": "agent",
                                "episode_reward": "0.75"}
    assert episode_reward("", "", None, rollout.metadata) == 0.75
    assert decode(encode(rollout)) == rollout


def test_an_edited_history_breaks_the_chain_and_trains_separate_turns_sharing_the_reward(tok):
    calls = _tool_episode(tok, edit_history=True)
    assert chain_breaks(calls) == [0]
    rollouts = assemble_group("calc-1", [Ended("calc-1/0", calls, _end("calc-1/0", 1.0))], "gw-0",
                              lambda ids: tok.decode(list(ids)))
    assert [r.sample_index for r in rollouts] == [0, 1] and {r.group_size for r in rollouts} == {2}
    assert all(r.policy_mask is None and r.metadata["gateway_mode"] == "turns" for r in rollouts)
    assert {r.metadata["episode_reward"] for r in rollouts} == {"1.0"}
    for rollout, call in zip(rollouts, calls):
        assert np.array_equal(rollout.prompt_token_ids, call.prompt_token_ids)
        assert np.array_equal(rollout.response_token_ids, call.response_token_ids)


def test_chain_rules_on_small_ids():
    a = _call("e", 0, [1, 2], [3])
    assert chain_breaks([a, _call("e", 1, [1, 2, 3, 9], [5])]) == []
    assert chain_breaks([a, _call("e", 1, [1, 2, 3], [5])]) == [0]  # nothing between the turns
    assert chain_breaks([a, _call("e", 1, [1, 2, 4, 9], [5])]) == [0]  # the sampled token re-tokenised
    assert chain_breaks([a, _call("e", 1, [1, 2, 3, 9], [5]), _call("e", 2, [7], [5])]) == [1]


def test_a_group_waits_for_its_episodes_and_a_dead_one_counts_but_is_not_trained():
    book = Book(group_size=2)
    book.add_call(_call("g/a", 0, [1], [2]), ("gw", 0, 5))
    book.add_call(_call("g/b", 0, [1], [3], t=90.0), ("gw", 0, 6))
    book.add_call(_call("solo", 0, [1], [4]), ("gw", 0, 7))
    assert group_of("g/a") == "g" and group_of("solo") == "solo"
    book.apply(_end("g/a", calls=1))
    assert book.ready("g") is None and book.state("g/a") == "ended"
    assert book.idle(now=101.0, timeout_s=5.0) == ["g/b"]
    book.apply(GatewayEpisode(episode_id="g/b", outcome="dead_lettered", reason="timeout", calls=1))
    assert [e.episode_id for e in book.ready("g")] == ["g/a"]
    book.apply(_end("solo", calls=1))
    assert book.ready_groups() == ["g", "solo"]
    assert book.open == {} and book.state("g/b") == "dead_lettered"
    assert book.counts() == {"open": 0, "ended": 2, "published": 0, "dead_lettered": 1}  # what its heartbeat says


def test_replaying_the_records_twice_rebuilds_the_same_book():
    records = [_call("g/a", 0, [1], [2]), _call("g/a", 1, [1, 2, 8], [3]), _end("g/a"),
               _call("h/a", 0, [1], [2]), GatewayEpisode(episode_id="g/a", outcome="published", reason="", calls=2)]
    once, twice = Book(2), Book(2)
    for book, times in ((once, 1), (twice, 2)):
        for _ in range(times):
            for r in records:
                book.add_call(r, None) if isinstance(r, GatewayCall) else book.apply(r)
    assert once.closed == twice.closed == {"g/a": "published"}
    assert list(once.open) == list(twice.open) == ["h/a"] and once.ended == twice.ended == {}
    assert sorted(twice.open["h/a"].calls) == [0]
    assert once.counts() == twice.counts() == {"open": 1, "ended": 0, "published": 1, "dead_lettered": 0}


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "unknown model 'other'"),
    ({"model": "m", "max_tokens": 17, "messages": [{"role": "user", "content": "hi"}]}, 400, "too many tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "robot"}]}, 400, "messages[1]"),
    ({"model": "m", "messages": []}, 400, "messages must be a non-empty list"),
    ({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}, 400, "temperature"),
])
def test_requests_the_gateway_cannot_serve_faithfully_are_refused_naming_why(body, status, words):
    with pytest.raises(RequestError) as caught:
        read_request(body, "chat", "m", 16)
    assert caught.value.status == status and words in str(caught.value)
    assert caught.value.body()["error"]["message"] == str(caught.value)


def test_a_sampled_tool_call_is_answered_as_an_openai_tool_call():
    answer = chat_answer("id-1", "m", '<tool_call>\n{"name": "calc", "arguments": {"a": 2}}\n</tool_call>', "stop",
                         {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, with_tools=True)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": "id-1-0", "type": "function", "function": {"name": "calc", "arguments": json.dumps({"a": 2})}}]


def test_a_sweep_slower_than_the_episode_timeout_is_refused_at_load_naming_both_fields():
    from stream_rl.cli.config import load_config
    from stream_rl.config.base import ConfigError

    with pytest.raises(ConfigError, match="gateway.sweep_interval_s=10 > gateway.episode_timeout_s=5"):
        load_config(None, env={}, overrides={"gateway.sweep_interval_s": 10, "gateway.episode_timeout_s": 5})
    assert load_config(None, env={}, overrides={"gateway.port": 0}).gateway.episode_timeout_s == 600.0


def test_the_episode_id_comes_from_the_header_else_the_api_key_and_a_bad_one_is_refused():
    from producers.gateway.server import episode_of

    assert episode_of({"X-Episode-Id": "g/1", "Authorization": "Bearer other"}) == "g/1"
    assert episode_of({"Authorization": "Bearer calc-7/2"}) == "calc-7/2"
    for headers, words in (({}, "missing episode id"), ({"X-Episode-Id": "bad id"}, "malformed episode id"),
                           ({"X-Episode-Id": "g" * 201 + "/1"}, "longer than 200")):
        with pytest.raises(RequestError, match=words):
            episode_of(headers)


def _dead(episode: str, t: float, refill: bool = False, calls: int = 1) -> GatewayEpisode:
    return GatewayEpisode(episode_id=episode, outcome="dead_lettered", reason="x", calls=calls, refill=refill,
                          created_at=t)


def _ended(episode: str, t: float) -> GatewayEpisode:
    return GatewayEpisode(episode_id=episode, outcome="ended", reward=1.0, reason="", calls=1, created_at=t)


def _feed(book: Book, records) -> Book:
    for r in records:
        book.add_call(r, None) if isinstance(r, GatewayCall) else book.apply(r)
    return book


def test_a_refilled_episode_does_not_count_and_its_replacement_completes_the_group():
    book = _feed(Book(group_size=2), [_call("g/0", 0, [1], [2], t=100.0), _dead("g/0", 101.0, refill=True)])
    assert (book.state("g/0"), book.members("g"), book.waiting_refills("g")) == ("dead_lettered", 0, 1)
    _feed(book, [_call("g/1", 0, [1], [3], t=102.0), _ended("g/1", 103.0)])
    assert book.ready("g") is None and (book.members("g"), book.waiting_refills("g")) == (1, 1)
    assert book.expired_refills(now=107.9, timeout_s=5.0) == []  # the group's last record: 103.0
    _feed(book, [_call("g/2", 0, [1], [4], t=104.0)])  # the replacement: the group owes nothing now
    assert (book.members("g"), book.waiting_refills("g")) == (2, 0)
    assert book.expired_refills(now=1e9, timeout_s=5.0) == []
    _feed(book, [_ended("g/2", 105.0)])
    assert [e.episode_id for e in book.ready("g")] == ["g/1", "g/2"]
    assert book.counts() == {"open": 0, "ended": 2, "published": 0, "dead_lettered": 1}


def test_a_replacement_that_never_comes_expires_and_its_episode_then_counts():
    records = [_call("g/0", 0, [1], [2], t=100.0), _dead("g/0", 101.0, refill=True, calls=1),
               _call("g/1", 0, [1], [3], t=102.0), _ended("g/1", 103.0)]
    book = _feed(Book(group_size=2), records)
    assert book.expired_refills(now=108.5, timeout_s=5.0) == [("g/0", 1)]
    expiry = _dead("g/0", 108.5)  # the gateway's second record of it, without refill
    _feed(book, [expiry])
    assert [e.episode_id for e in book.ready("g")] == ["g/1"] and book.dead_in_group == {"g": 1}
    assert (book.members("g"), book.waiting_refills("g"), book.expired_refills(now=1e9, timeout_s=5.0)) == (2, 0, [])
    assert book.counts()["dead_lettered"] == 1  # one episode, dead-lettered once
    twice = _feed(_feed(Book(group_size=2), [*records, expiry]), [*records, expiry])
    assert (twice.dead_in_group, twice.members("g"), twice.waiting_refills("g"), twice.counts()) == (
        book.dead_in_group, 2, 0, book.counts())
    assert [e.episode_id for e in twice.ready("g")] == ["g/1"]


def test_a_refill_waits_while_its_group_has_an_open_episode_and_a_failed_replacement_can_be_refilled():
    book = _feed(Book(group_size=3), [_dead("g/0", 100.0, refill=True, calls=0), _call("g/1", 0, [1], [2], t=101.0)])
    assert book.expired_refills(now=1e9, timeout_s=5.0) == []  # g/1 is open (the sweep times it out on its own)
    _feed(book, [_ended("g/1", 102.0), _call("g/3", 0, [1], [2], t=103.0), _dead("g/3", 104.0, refill=True)])
    assert (book.members("g"), book.waiting_refills("g")) == (1, 2)  # g/3 replaced g/0, and is replaced in turn
    assert book.expired_refills(now=110.0, timeout_s=5.0) == [("g/0", 0), ("g/3", 1)]
    solo = _feed(Book(group_size=3), [_dead("g/0", 100.0)])
    assert (solo.members("g"), solo.dead_in_group) == (1, {"g": 1})  # without refill it counts at once


def test_refill_is_checked_on_the_wire_and_on_the_end_request_naming_the_field():
    import msgpack

    from producers.gateway.service import _read_end
    from schemas import SchemaError

    for bad, words in (({"episode_id": "g/0", "outcome": "ended", "reason": ""}, "refill: may be true only"),
                       ({"episode_id": "solo", "outcome": "dead_lettered", "reason": "x"}, "needs an episode of a")):
        with pytest.raises(SchemaError, match=words):
            encode(GatewayEpisode(**bad, calls=0, refill=True))
    older = msgpack.unpackb(encode(_dead("g/0", 100.0)))
    del older["refill"]  # written before the field was added
    assert decode(msgpack.packb(older)).refill is False
    assert _read_end({"failed": "tool crashed", "refill": True}, "g/0").refill is True
    assert _read_end({"failed": "tool crashed"}, "g/0").refill is False
    for body, episode, words in (({"failed": "x", "refill": "yes"}, "g/0", "refill must be true or false"),
                                 ({"reward": 1.0, "refill": True}, "g/0", "refill needs failed"),
                                 ({"failed": "x", "refill": True}, "solo", "refill needs an episode of a group")):
        with pytest.raises(RequestError, match=words) as caught:
            _read_end(body, episode)
        assert caught.value.body()["error"]["param"] == "refill"
