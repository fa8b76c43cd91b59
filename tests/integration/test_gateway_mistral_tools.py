"""The gateway with a Mistral model's tokenizer and its real chat template (Mistral-Nemo-Instruct-2407, verbatim;
``[TOOL_CALLS]`` and the other markers are special tokens), on the real broker, driven by the unmodified ``openai``
client: the tool-call format is read off the template (``gateway.tool_format = "auto"``), the sampled call comes
back to the agent as an OpenAI tool call with the id the model sampled, the agent's next call renders on the
template exactly as the model wrote it, and the episode is published as one multi-turn rollout with the policy's
tokens masked in.

The policy is played by :class:`ScriptedPolicy`, which answers each call with the next text of a script (a model
that has learned Mistral's format; a random tiny model never samples one): the gateway, its service, renderer and
topics are the real ones.
"""

from __future__ import annotations

import openai
import pytest
from support.chat import build_template_tokenizer
from support.gateway import end_episode, start_gateway
from support.producers import collect
from support.topics import read_records

from producers.engines.base import GenerationEngine, Sample

pytestmark = pytest.mark.broker
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "add two integers",
                                           "parameters": {"type": "object"}}}]
SCRIPT = ['[TOOL_CALLS][{"name": "calc", "arguments": {"a": 2, "b": 3}, "id": "c4lc0000a"}]</s>', "5</s>"]


class ScriptedPolicy(GenerationEngine):
    """Answers call k with the token ids of ``SCRIPT[k]`` (behaviour logprob -0.5 each), at version 0."""

    def __init__(self, tokenizer):
        self._tokenizer, self._version, self._eos, self.prompts = tokenizer, 0, tokenizer.eos_token_id, []

    max_model_len = property(lambda self: 4096)
    vocab_size = property(lambda self: len(self._tokenizer))

    def generate(self, prompt_token_ids, n, sampling, max_new_tokens, seed):
        self.prompts.append(list(prompt_token_ids[0]))
        ids = list(self._tokenizer(SCRIPT[len(self.prompts) - 1], add_special_tokens=False)["input_ids"])
        return [[Sample(ids, [-0.5] * len(ids), "stop")] for _ in prompt_token_ids]

    def load_weights(self, state_dict, version):
        raise NotImplementedError


def test_a_mistral_tool_call_round_trips_through_the_gateway_as_one_rollout(make_config, tmp_path):
    from schemas import GatewayCall, decode
    from stream_rl.transport.client import Transport

    tokenizer = build_template_tokenizer("mistral-nemo")
    tokenizer.save_pretrained(tmp_path / "policy")
    policy = ScriptedPolicy(tokenizer)
    cfg = make_config(**{"producer.model_dir": str(tmp_path / "policy"), "producer.max_new_tokens": 64,
                         "producer.follow_weights": False, "gateway.port": 0})
    gateway = start_gateway(cfg, policy)
    try:
        client = openai.OpenAI(base_url=gateway.url, api_key="calc-1", max_retries=0)
        messages = [{"role": "user", "content": "2+3?"}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert (call.id, call.function.name, call.function.arguments) == ("c4lc0000a", "calc", '{"a": 2, "b": 3}')
        messages += [message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert second.choices[0].message.content == "5" and not second.choices[0].message.tool_calls
        assert end_episode(gateway.url, "calc-1", {"reward": 1.0})["state"] == "published"
        p0, p1 = policy.prompts
        s0 = list(tokenizer(SCRIPT[0], add_special_tokens=False)["input_ids"])
        gap = tokenizer.decode(p1[len(p0) + len(s0):])
        assert p1[:len(p0) + len(s0)] == p0 + s0  # the template wrote the call back as the model sampled it
        assert gap == '[TOOL_RESULTS]{"content": 5, "call_id": "c4lc0000a"}[/TOOL_RESULTS]'
        transport = Transport(cfg, "test")
        (rollout,) = [r.value for r in collect(transport, transport.names.rollouts, want=1, timeout_s=30)]
        calls = [m for m in (decode(r.value) for r in read_records(transport, transport.names.name("gateway"), None))
                 if isinstance(m, GatewayCall)]
        assert [c.call_index for c in calls] == [0, 1] and rollout.metadata["gateway_mode"] == "chain"
        s1 = list(tokenizer(SCRIPT[1], add_special_tokens=False)["input_ids"])
        assert rollout.response_token_ids.tolist() == p1[len(p0):] + s1
        assert rollout.policy_mask.tolist() == [1] * len(s0) + [0] * (len(p1) - len(p0) - len(s0)) + [1] * len(s1)
    finally:
        gateway.finish()
    assert gateway.error is None, gateway.error
