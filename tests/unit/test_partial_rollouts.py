"""Durable partial rollouts without a broker (issue 41.2): the partial group's wire rules, the split of its
prefixes, the concatenation of prefix and continuation, the staleness rule, the resumption step on a scripted
engine (exact ids, logprobs and versions) and the settings refused at load."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.messages import make_partial_group

from producers.config import ProducerConfig
from producers.engines.base import GenerationEngine, Sample, Sampling
from producers.partials import join, prefixes, resume_partials, stale_reason
from schemas import SchemaError, decode, encode


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(t) for t in ids)


class ScriptedEngine(GenerationEngine):
    """Every prompt continues with [10, 2] (logprobs -0.5, -0.25); records its calls."""

    def __init__(self, version: int):
        self._version, self._tokenizer, self._eos, self.calls = version, _Tokenizer(), 2, []

    max_model_len = property(lambda self: 32)
    vocab_size = property(lambda self: 20)

    def generate(self, prompt_token_ids, n, sampling, max_new_tokens, seed):
        self.calls.append(([list(p) for p in prompt_token_ids], n, max_new_tokens))
        return [[Sample([10, 2], [-0.5, -0.25], "stop") for _ in range(n)] for _ in prompt_token_ids]

    def load_weights(self, state_dict, version):
        raise NotImplementedError


def test_a_partial_group_round_trips_and_its_rules_name_the_field():
    partial = make_partial_group()
    assert decode(encode(partial)) == partial
    for bad, field in (
            (make_partial_group(group_id="other:2"), "group_id"),
            (make_partial_group(finish_reasons=["stop"]), "finish_reasons"),
            (make_partial_group(finish_reasons=["stop", "stop"]), "finish_reasons"),  # nothing to resume
            (make_partial_group(finish_reasons=["stop", "abort"]), "finish_reasons"),
            (make_partial_group(token_policy_versions=np.array([5, 5, 5, 5], np.int64)), "token_policy_versions"),
            (make_partial_group(sample_lengths=np.array([2, 0], np.int32)), "sample_lengths"),
            (make_partial_group(cuts=0), "cuts")):
        with pytest.raises(SchemaError, match=rf"partial_group\.{field}"):
            encode(bad)


def test_prefixes_split_the_flat_arrays_per_sample():
    (first, first_cut), (second, second_cut) = prefixes(make_partial_group())
    assert (first.token_ids, first.logprobs, first.token_versions, first_cut) == ([9, 2], [-0.5, -0.25], [5, 5], False)
    assert first.finish_reason == "stop"
    assert (second.token_ids, second.logprobs, second.token_versions, second_cut) == (
        [11, 12, 13], [-1.0, -2.0, 0.0], [5, 5, 6], True)


def test_join_keeps_the_prefix_versions_and_takes_the_continuation_finish_reason():
    prefix = Sample([11, 12, 13], [-1.0, -2.0, 0.0], "length", [5, 5, 6])
    joined = join(prefix, Sample([10, 2], [-0.5, -0.25], "stop"), version=8)
    assert joined == Sample([11, 12, 13, 10, 2], [-1.0, -2.0, 0.0, -0.5, -0.25], "stop", [5, 5, 6, 8, 8])
    inflight = join(prefix, Sample([10, 2], [-0.5, -0.25], "length", [8, 9]), version=9)  # its own versions
    assert inflight.token_versions == [5, 5, 6, 8, 9] and inflight.finish_reason == "length"


def test_the_staleness_rule_on_exact_values():
    partial = make_partial_group()  # oldest prefix token: v5
    assert stale_reason(partial, version=7, max_lag=2) is None  # lag 2 = bound: resumed
    assert stale_reason(partial, version=5, max_lag=0) is None
    reason = stale_reason(partial, version=8, max_lag=2)
    assert reason == "partial prefix lag 3 > producer.partial_max_lag 2 (oldest token v5, weights v8)"


def test_resumption_continues_each_cut_sample_and_keeps_the_ended_ones_whole():
    engine = ScriptedEngine(version=6)
    result = resume_partials([make_partial_group()], engine, producer_id="p1", sampling=Sampling(),
                             max_new_tokens=8, max_lag=1, seed=0)
    assert engine.calls == [([[5, 6, 7, 11, 12, 13]], 1, 5)]  # prompt + prefix, the remaining 8 - 3 tokens
    first, second = result.rollouts
    assert [r.rollout_id for r in result.rollouts] == ["gsm8k/train-17:2:0", "gsm8k/train-17:2:1"]
    assert first.response_token_ids.tolist() == [9, 2] and first.token_policy_versions.tolist() == [5, 5]
    assert first.finish_reason == "stop"
    assert second.response_token_ids.tolist() == [11, 12, 13, 10, 2]
    assert second.behavior_logprobs.tolist() == [-1.0, -2.0, 0.0, -0.5, -0.25]
    assert second.token_policy_versions.tolist() == [5, 5, 6, 6, 6]  # the prefix keeps its versions
    assert second.finish_reason == "stop" and second.attempt == 1 and second.group_size == 2
    assert second.prompt_token_ids.tolist() == [5, 6, 7]
    assert result.metrics["producer/partials_resumed"] == 1 and result.metrics["producer/partials_stale"] == 0
    assert result.metrics["producer/partials_kept_tokens"] == 5 and result.metrics["producer/partials_new_tokens"] == 2


def test_a_stale_partial_is_dropped_and_its_prompt_regenerated_from_scratch():
    engine = ScriptedEngine(version=7)  # oldest prefix token v5: lag 2 > 1
    result = resume_partials([make_partial_group()], engine, producer_id="p1", sampling=Sampling(),
                             max_new_tokens=8, max_lag=1, seed=0)
    assert engine.calls == [([[5, 6, 7]], 2, 8)]  # the whole group, from the prompt, with the whole budget
    assert [r.response_token_ids.tolist() for r in result.rollouts] == [[10, 2], [10, 2]]
    assert all(r.attempt == 2 and r.token_policy_versions.tolist() == [7, 7] for r in result.rollouts)
    assert result.metrics["producer/partials_stale"] == 1 and result.metrics["producer/partials_resumed"] == 0
    # the dropped prefix goes on record (the producer dead-letters it as StalePartial), naming the lag
    assert [d.index for d in result.dropped] == [0] and result.dropped[0].reason.startswith("stale partial group: ")
    assert result.dropped[0].reason.endswith("; its prompt is regenerated from scratch")

    class Recorded:  # the transport's dead_letter, recorded (publish's collaborator, not the thing under test)
        letters: list = []

        def dead_letter(self, topic, partition, offset, key, raw, reason, error_type, headers=None):
            self.letters.append((offset, error_type, reason))

    class Acked:
        def oversize(self, *args):
            return None

        def send(self, *args, **kw):
            pass

        def flush(self):
            pass

    from types import SimpleNamespace

    from producers.publish import publish

    record = SimpleNamespace(topic="partials", partition=0, offset=9, key=b"g", raw_value=b"",
                             value=make_partial_group(), headers=[])
    publish(result, [record], Recorded(), Acked(), "rollouts", group_of=lambda r: r.value.group_id)
    assert Recorded.letters == [(9, "StalePartial", result.dropped[0].reason)]


def test_a_cut_sample_with_no_budget_left_is_kept_as_it_is():
    partial = make_partial_group()
    result = resume_partials([partial], ScriptedEngine(version=6), producer_id="p1", sampling=Sampling(),
                             max_new_tokens=3, max_lag=1, seed=0)
    assert result.rollouts[1].response_token_ids.tolist() == [11, 12, 13]
    assert result.rollouts[1].finish_reason == "length"


def test_settings_that_cannot_work_are_refused_naming_the_fields():
    assert ProducerConfig(oversample=1.0, partial_max_lag=2).partial_max_lag == 2
    assert ProducerConfig().partial_max_lag is None  # off by default: today's regenerate-from-scratch
    with pytest.raises(ValueError, match="producer.partial_max_lag needs producer.oversample"):
        ProducerConfig(partial_max_lag=1)
    with pytest.raises(ValueError, match="producer.partial_max_lag with producer.stop"):
        ProducerConfig(abort_after_s=1.0, partial_max_lag=1, stop=["\n\n"])
    assert ProducerConfig(oversample=1.0, partial_max_lag=1, engine="server").partial_max_lag == 1  # it cuts too
    with pytest.raises(ValueError, match="multi-turn"):
        ProducerConfig(oversample=1.0, partial_max_lag=1, environment="a.b:C")


def test_the_partial_lag_may_not_exceed_the_trainers():
    from stream_rl.cli.config import load_config

    overrides = {"producer.oversample": "1.0", "trainer.max_lag": "2"}
    loaded = load_config(None, env={}, overrides={**overrides, "producer.partial_max_lag": "2"})
    assert loaded.producer.partial_max_lag == 2
    with pytest.raises(Exception, match=r"producer\.partial_max_lag=3 > trainer\.max_lag=2"):
        load_config(None, env={}, overrides={**overrides, "producer.partial_max_lag": "3"})


def test_the_partial_group_carries_the_prompt_whole():
    partial = make_partial_group()
    again = decode(encode(dataclasses.replace(partial, cuts=2)))
    assert again.prompt == partial.prompt and again.cuts == 2


def test_replay_redacts_a_partial_groups_content():
    from types import SimpleNamespace

    from stream_rl.operator_tools.replay import Redactor, record_to_json

    partial = make_partial_group()
    rec = SimpleNamespace(topic="stream-rl.r.partials", partition=0, offset=3, timestamp_ms=0,
                          key=partial.group_id.encode(), value=encode(partial))
    out = record_to_json(rec, redactor=Redactor(b"k" * 32))
    value = out["value"]
    assert value["token_ids"] == "<redacted: 5 tokens>" and value["prompt_token_ids"] == "<redacted: 3 tokens>"
    assert value["prompt"]["text"] == "<redacted: 4 chars>" and value["prompt"]["answer"] == "<redacted: 1 chars>"
    assert value["group_id"].startswith("#") and value["group_id"].endswith(":2") and out["key"].startswith("#")
    assert value["token_policy_versions"] == [5, 5, 5, 5, 6]  # numbers are kept
    assert "train-17" not in str(out)
