"""The gateway for black-box agents on the real broker, driven by the real ``openai`` client: a tool-using agent's
calls are recorded and its episode published as rollouts; concurrent episodes never mix; a streamed call is
recorded as a whole one; bad requests are refused with OpenAI errors naming why; a killed agent's episode is
dead-lettered with its reason; a restarted gateway loses no recorded call; a failed episode ended with ``refill`` waits
for its replacement, or is counted once its group waited ``gateway.episode_timeout_s``, and a restart rebuilds both.

A tiny chat policy (support.chat_model) with a tool-use template (support.chat.TOOLS_TEMPLATE) on the hf engine,
one engine shared by the module's tests; each test has its own run (topics) and its own gateway thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from urllib.parse import quote

import openai
import pytest
import torch
from support.chat import TOOLS_TEMPLATE
from support.chat_model import build_chat_model_dir
from support.gateway import end_episode, start_gateway
from support.producers import collect
from support.topics import read_records
from support.waiting import wait_for

from producers.gateway.calls import parse_tool_calls
from producers.gateway.episodes import chain_breaks

pytestmark = pytest.mark.broker
torch.set_num_threads(1)
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "add two integers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """(model dir, template file, engine) shared by the module."""
    from producers.engines.hf import HFEngine

    root = tmp_path_factory.mktemp("gateway-policy")
    model = build_chat_model_dir(root / "policy")
    template = root / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    engine = HFEngine.from_dir(model)
    yield model, template, engine
    engine.close()


@pytest.fixture
def start(make_config, policy):
    """Start a gateway thread on this test's run: ``start(**overrides) -> (url, cfg, stop)``; stopped at the end."""
    model, template, engine = policy
    running = []

    def _start(**overrides):
        cfg = make_config(**{"producer.model_dir": str(model), "producer.max_new_tokens": 6,
                             "producer.follow_weights": False, "data.chat_template": str(template),
                             "gateway.port": 0, "gateway.sweep_interval_s": 0.2, **overrides})
        gateway = start_gateway(cfg, engine)
        running.append(gateway)
        return gateway.url, cfg, gateway.stop, gateway.thread

    yield _start
    for gateway in running:
        gateway.finish()
        assert gateway.error is None, gateway.error


def _agent(url: str, episode: str, reward: float) -> None:
    """A tool-using agent with the unmodified openai client: ask, run the calculator on a tool call (or tell the
    model the calculator's result), ask again, end the episode with its environment's reward."""
    client = openai.OpenAI(base_url=url, api_key=episode, max_retries=0)
    messages = [{"role": "user", "content": "What is 2+3? Use the calculator."}]
    for _ in range(2):
        answer = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
        else:
            messages.append({"role": "user", "content": "The calculator says 5."})
    assert end_episode(url, episode, {"reward": reward})["state"] == "published"


def _calls(transport, topic: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for record in read_records(transport, topic, None):
        from schemas import GatewayCall, decode

        message = decode(record.value)
        if isinstance(message, GatewayCall):
            out.setdefault(message.episode_id, []).append(message)
    return out


def test_concurrent_tool_using_agents_are_recorded_and_published_without_mixing(start):
    from stream_rl.operator_tools.status import build_snapshot
    from stream_rl.transport.client import Transport

    url, cfg, stop, thread = start()
    rewards = {"calc-a": 0.25, "calc-b": 0.75, "calc-c": 1.0}
    agents = [threading.Thread(target=_agent, args=(url, e, r)) for e, r in rewards.items()]
    for agent in agents:
        agent.start()
    for agent in agents:
        agent.join(120)
    transport = Transport(cfg, "test")
    calls = _calls(transport, transport.names.name("gateway"))
    assert {e: [c.call_index for c in cs] for e, cs in calls.items()} == {e: [0, 1] for e in rewards}
    rollouts = [r.value for r in collect(transport, transport.names.rollouts, want=len(rewards), timeout_s=30)]
    by_episode: dict[str, list] = {}
    for rollout in rollouts:
        by_episode.setdefault(rollout.metadata["episode_id"], []).append(rollout)
    for episode, own in by_episode.items():
        mine = calls[episode]
        chained = not chain_breaks(mine)
        assert [r.metadata["gateway_mode"] for r in own] == (["chain"] if chained else ["turns", "turns"])
        assert {r.metadata["episode_reward"] for r in own} == {json.dumps(rewards[episode])}
        assert all(r.prompt_id == episode and r.answer is None for r in own)
        assert own[0].prompt_token_ids.tolist() == mine[0].prompt_token_ids.tolist()  # its own prompt, no other's
        if chained:  # one rollout: the last call's prompt and answer, the policy's tokens masked in
            whole = mine[1].prompt_token_ids.tolist() + mine[1].response_token_ids.tolist()
            assert own[0].prompt_token_ids.tolist() + own[0].response_token_ids.tolist() == whole
            assert int(own[0].policy_mask.sum()) == sum(len(c.response_token_ids) for c in mine)
    assert set(by_episode) == set(rewards)
    first = json.loads(calls["calc-a"][0].messages_json)
    assert first == [{"role": "user", "content": "What is 2+3? Use the calculator."}]  # as the agent sent them
    assert json.loads(calls["calc-a"][0].tools_json) == TOOLS
    stop.set()  # its last heartbeat ("stopping") carries the final counters; stream-rl status shows them
    thread.join(30)
    beats = [r.value for r in read_records(transport, transport.names.status, "heartbeat") if r.value.role == "gateway"]
    snap = build_snapshot(run=cfg.topics.run, now=beats[-1].created_at, heartbeats=beats, manifest=None, marks={})
    tokens = float(sum(len(c.response_token_ids) for cs in calls.values() for c in cs))
    assert snap["gateways"][beats[-1].instance_id] == {
        "gateway/calls": 6.0, "gateway/dropped_clients": 0.0, "gateway/episodes_dead_lettered": 0.0,
        "gateway/episodes_ended": 0.0, "gateway/episodes_open": 0.0, "gateway/episodes_published": 3.0,
        "gateway/refused_connections": 0.0, "gateway/tokens": tokens}
    assert beats[-1].state == "stopping" and beats[-1].step == 6


def test_a_streamed_call_is_recorded_as_a_whole_one_and_its_deltas_join_to_the_recorded_answer(start):
    from stream_rl.transport.client import Transport

    url, cfg, _, _ = start()
    client = openai.OpenAI(base_url=url, api_key="streamed", max_retries=0)
    hello = [{"role": "user", "content": "What is 2+3? Use the calculator."}]
    parts = list(client.chat.completions.create(model="policy", messages=hello, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True}))
    chunks = [c for c in parts if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens >= 1
    completion = openai.OpenAI(base_url=url, api_key="streamed-text", max_retries=0)
    pieces = list(completion.completions.create(model="policy", prompt="2+3=", max_tokens=4, stream=True))
    transport = Transport(cfg, "test")
    recorded = _calls(transport, transport.names.name("gateway"))
    (chat,), (plain,) = recorded["streamed"], recorded["streamed-text"]
    assert parts[-1].usage.completion_tokens == len(chat.response_token_ids)
    # the deltas join to exactly the answer of the recorded call: its text, read for tool calls
    whole_content, whole_calls = parse_tool_calls(chat.response_text, "chatcmpl-streamed-0")
    assert content == (whole_content or "")
    assert [(t.id, t.function.name, t.function.arguments) for t in calls] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"]) for t in whole_calls]
    assert chunks[-1].choices[0].finish_reason == ("tool_calls" if calls else chat.finish_reason)
    assert "".join(p.choices[0].text for p in pieces) == plain.response_text
    assert pieces[-1].choices[0].finish_reason == plain.finish_reason


def test_bad_requests_are_refused_with_openai_errors_naming_why(start):
    url, _, _, _ = start(**{"gateway.max_body_bytes": 1024})
    client = openai.OpenAI(base_url=url, api_key="refusals", max_retries=0)
    hello = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="stream must be true or false"):
        client.chat.completions.create(model="policy", messages=hello, extra_body={"stream": "yes"})
    with pytest.raises(openai.NotFoundError, match="unknown model 'gpt-4o'"):
        client.chat.completions.create(model="gpt-4o", messages=hello)
    with pytest.raises(openai.BadRequestError, match="too many tokens: max_tokens=7"):
        client.chat.completions.create(model="policy", messages=hello, max_tokens=7)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]"):
        client.chat.completions.create(model="policy", messages=[{"role": "robot", "content": "x"}])
    request = urllib.request.Request(f"{url}/chat/completions", method="POST",
                                     data=json.dumps({"model": "policy", "messages": hello}).encode())
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request, timeout=30)
    assert missing.value.code == 400 and "missing episode id" in json.loads(missing.value.read())["error"]["message"]
    with pytest.raises(openai.APIStatusError, match="over gateway.max_body_bytes=1024") as large:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x" * 2000}])
    assert large.value.status_code == 413
    text = client.completions.create(model="policy", prompt="2+3=", max_tokens=4)  # the completions endpoint
    assert text.choices[0].finish_reason in ("stop", "length") and text.usage.completion_tokens >= 1


AGENT = """
import sys, time, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2+3?"}], max_tokens=4)
print("called", flush=True)
time.sleep(600)
"""


def test_a_killed_agents_episode_is_dead_lettered_with_its_reason_and_never_trained(start):
    from schemas import decode
    from stream_rl.transport.client import Transport

    url, cfg, _, _ = start(**{"gateway.episode_timeout_s": 1.0})
    agent = subprocess.Popen([sys.executable, "-c", AGENT, url, "crashy"], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    try:
        assert agent.stdout.readline().strip() == "called"
    finally:
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(30)
    transport = Transport(cfg, "test")
    letters = wait_for(lambda: [decode(r.value) for r in read_records(transport, transport.names.dlq, None)],
                       timeout_s=30, what="the dead letter of the killed agent's episode")
    (letter,) = letters
    assert letter.error_type == "EpisodeTimeout" and "gateway.episode_timeout_s=1" in letter.reason
    assert letter.raw_key == b"crashy" and letter.source_topic == transport.names.name("gateway")
    assert decode(letter.raw_value).episode_id == "crashy"  # it points at the episode's first call
    assert read_records(transport, transport.names.rollouts, None) == []
    client = openai.OpenAI(base_url=url, api_key="crashy", max_retries=0)
    with pytest.raises(openai.ConflictError, match="dead-lettered"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}])


def test_a_restarted_gateway_loses_no_recorded_call(start):
    from stream_rl.transport.client import Transport

    url, cfg, stop, thread = start()
    client = openai.OpenAI(base_url=url, api_key="survivor", max_retries=0)
    messages = [{"role": "user", "content": "2+3?"}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    stop.set()
    thread.join(30)
    url, _, _, _ = start(**{"topics.run": cfg.topics.run})  # the same run: the gateway topic is replayed
    client = openai.OpenAI(base_url=url, api_key="survivor", max_retries=0)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    assert end_episode(url, "survivor", {})["state"] == "published"  # no reward: the scorer's reward functions score it
    transport = Transport(cfg, "test")
    calls = _calls(transport, transport.names.name("gateway"))["survivor"]
    assert [c.call_index for c in calls] == [0, 1]
    rollouts = [r.value for r in collect(transport, transport.names.rollouts, want=1, timeout_s=30)]
    assert {r.metadata["reward_source"] for r in rollouts} == {"scorer"}
    assert rollouts[0].prompt_token_ids.tolist() == calls[0].prompt_token_ids.tolist()
    assert sum(len(r.response_token_ids) for r in rollouts) >= sum(len(c.response_token_ids) for c in calls)


def test_a_refilled_episode_waits_for_its_replacement_or_is_counted_after_the_timeout_and_a_restart_keeps_both(start):
    from schemas import GatewayEpisode, decode
    from stream_rl.transport.client import Transport

    url, cfg, stop, thread = start(**{"gateway.group_size": 2, "gateway.episode_timeout_s": 2.0})

    def call(episode: str) -> None:
        openai.OpenAI(base_url=url, api_key=episode, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "2+3?"}], max_tokens=3)

    def group(answer: dict) -> tuple:
        return answer["state"], answer["members"], answer["refills_waiting"]

    call("g/0")
    assert group(end_episode(url, "g/0", {"failed": "the tool crashed", "refill": True})) == ("dead_lettered", 0, 1)
    call("g/1")
    assert group(end_episode(url, "g/1", {"reward": 1.0})) == ("ended", 1, 1)  # waits for g/0's replacement
    call("g/2")
    assert group(end_episode(url, "g/2", {"reward": 0.5})) == ("published", 2, 0)
    assert group(end_episode(url, "h/0", {"failed": "no harness", "refill": True})) == ("dead_lettered", 0, 1)
    call("h/1")
    assert group(end_episode(url, "h/1", {"reward": 1.0})) == ("ended", 1, 1)
    transport = Transport(cfg, "test")
    rollouts = [r.value for r in collect(transport, transport.names.rollouts, want=3, timeout_s=30)]
    assert sorted(r.metadata["episode_id"] for r in rollouts) == ["g/1", "g/2", "h/1"]  # h: after 2 s, without h/0
    assert {r.group_size for r in rollouts if r.prompt_id == "h"} == {1}
    gateway_topic = [decode(r.value) for r in read_records(transport, transport.names.name("gateway"), None)]
    h0 = [(m.refill, m.reason) for m in gateway_topic if isinstance(m, GatewayEpisode) and m.episode_id == "h/0"]
    assert [refill for refill, _ in h0] == [True, False]
    assert "its replacement did not start within gateway.episode_timeout_s=2" in h0[1][1]
    letters = [decode(r.value) for r in read_records(transport, transport.names.dlq, None)]
    assert sorted(x.raw_key for x in letters) == [b"g/0", b"h/0"]  # one letter each: the expiry writes none
    def states(url: str) -> dict[str, tuple]:
        return {e: group(json.loads(urllib.request.urlopen(f"{url}/episodes/{quote(e, safe='')}", timeout=30).read()))
                for e in ("g/0", "g/1", "h/0", "h/1")}

    before = states(url)
    assert before == {"g/0": ("dead_lettered", 2, 0), "g/1": ("published", 2, 0), "h/0": ("dead_lettered", 2, 0),
                      "h/1": ("published", 2, 0)}
    stop.set()
    thread.join(30)
    url, _, _, _ = start(**{"topics.run": cfg.topics.run, "gateway.group_size": 2, "gateway.episode_timeout_s": 2.0})
    assert states(url) == before
    assert len(read_records(transport, transport.names.rollouts, None)) == 3  # nothing published twice
