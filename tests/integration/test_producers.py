"""Producers: the hf engine's exact behaviour logprobs, the pure step, and the Kafka loop on the real broker."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from support.producers import (
    PROMPTS,
    FakeEngine,
    build_tiny_model_dir,
    collect,
    perturbed_state_dict,
    prompt_record,
    recompute_logprobs,
    reference_model,
    send_prompts,
    start_producer,
    stop_producer,
)
from support.topics import caught_up, check_role_telemetry, heartbeats, only_export
from support.waiting import wait_for

from producers.config import ProducerConfig
from producers.engines.base import EngineError, Sample, Sampling, WeightsMismatch, cut_at_stop, prompt_seed
from producers.engines.hf import HFEngine
from producers.step import batch_seed, produce_rollouts
from schemas import Rollout, encode, group_id_for, rollout_id_for

torch.set_num_threads(1)

TEMPERATURE = 0.7


# ----------------------------------------------------------------------------------------------- shared helpers










@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "policy")


@pytest.fixture(scope="module")
def engine(model_dir) -> HFEngine:
    return HFEngine.from_dir(model_dir)


# ----------------------------------------------------------------------------------------------- hf engine
def test_behaviour_logprobs_equal_a_full_forward_recomputation_with_left_padding(engine, model_dir):
    groups = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=3)
    assert [len(g) for g in groups] == [4, 4, 4]
    model = reference_model(model_dir)
    recomputed, behaviour = recompute_logprobs(model, PROMPTS, groups, TEMPERATURE, engine.tokenizer.pad_token_id)
    assert np.abs(recomputed - behaviour).mean() < 1e-4
    assert np.abs(recomputed - behaviour).max() < 1e-3
    # the check can fail: the same tokens at temperature 1 (the raw distribution) give clearly different values
    raw, _ = recompute_logprobs(model, PROMPTS, groups, 1.0, engine.tokenizer.pad_token_id)
    assert np.abs(raw - behaviour).mean() > 1e-2


def test_the_decode_loop_draws_what_transformers_generate_draws_with_the_same_seed(engine):
    """One prefill per prompt (cache repeated per sample) against generate(num_return_sequences=n), which prefills
    every row: the same RNG stream and the same distributions give the same tokens, and the behaviour logprobs are
    generate's raw logits under log softmax(logits / T)."""
    from transformers import GenerationConfig

    from producers.engines.base import prompt_seed
    from producers.engines.hf import left_pad

    n, steps = 4, 8
    groups = engine.generate(PROMPTS, n=n, sampling=Sampling(TEMPERATURE), max_new_tokens=steps, seed=11)
    ids, mask = left_pad(PROMPTS, engine.tokenizer.pad_token_id)
    config = GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, num_return_sequences=n,
                              max_new_tokens=steps, eos_token_id=engine.eos_token_id,
                              pad_token_id=engine.tokenizer.pad_token_id)
    with torch.random.fork_rng(), torch.inference_mode():
        torch.manual_seed(prompt_seed(11, 0))
        out = engine.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                    output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[:, ids.shape[1]:]  # [B*n, S]
    logp = torch.stack([torch.log_softmax(x.float() / TEMPERATURE, -1) for x in out.logits], 1)  # [B*n, S, V]
    for row, sample in enumerate(s for g in groups for s in g):
        k = len(sample.token_ids)
        assert sample.token_ids == tokens[row, :k].tolist()
        expected = logp[row, torch.arange(k), tokens[row, :k]]
        assert np.allclose(sample.logprobs, expected.numpy(), atol=1e-5)
    assert len({tuple(s.token_ids) for g in groups for s in g}) > 4  # the samples really differ


def test_samples_end_at_eos_with_stop_or_run_to_the_budget_with_length(engine):
    groups = engine.generate(PROMPTS, n=16, sampling=Sampling(1.0), max_new_tokens=6, seed=0)
    samples = [s for g in groups for s in g]
    eos = engine.eos_token_id
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) >= 1
        assert all(lp <= 0.0 for lp in s.logprobs)
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == eos and eos not in s.token_ids[:-1]
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == 6 and eos not in s.token_ids
    assert {s.finish_reason for s in samples} == {"stop", "length"}


def test_same_seed_same_samples_other_seed_other_samples(engine):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = engine.generate(PROMPTS, n=4, sampling=Sampling(1.0), max_new_tokens=6, seed=7)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG stream is left as it was
    b = engine.generate(PROMPTS, n=4, sampling=Sampling(1.0), max_new_tokens=6, seed=7)
    c = engine.generate(PROMPTS, n=4, sampling=Sampling(1.0), max_new_tokens=6, seed=8)
    assert a == b
    assert a != c


def test_load_weights_changes_samples_and_version_and_logprobs_follow_the_new_weights(model_dir):
    engine = HFEngine.from_dir(model_dir)
    before = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=8, seed=5)
    assert engine.version == 0
    new_weights = perturbed_state_dict(model_dir)
    engine.load_weights(new_weights, version=3)
    assert engine.version == 3
    after = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=8, seed=5)
    assert after != before
    recomputed, behaviour = recompute_logprobs(reference_model(model_dir, new_weights), PROMPTS, after,
                                               TEMPERATURE, engine.tokenizer.pad_token_id)
    assert np.abs(recomputed - behaviour).mean() < 1e-4


def test_a_state_dict_that_does_not_fit_changes_nothing(model_dir):
    engine = HFEngine.from_dir(model_dir)
    before = engine.generate(PROMPTS, n=2, sampling=Sampling(1.0), max_new_tokens=6, seed=1)
    broken = perturbed_state_dict(model_dir)
    broken.pop("model.norm.weight")
    with pytest.raises(WeightsMismatch, match="model.norm.weight"):
        engine.load_weights(broken, version=1)
    assert engine.version == 0
    assert engine.generate(PROMPTS, n=2, sampling=Sampling(1.0), max_new_tokens=6, seed=1) == before


def test_generate_refuses_prompts_that_do_not_fit(engine):
    with pytest.raises(EngineError, match="max_model_len"):
        engine.generate([[1] * 60], n=1, sampling=Sampling(1.0), max_new_tokens=8, seed=0)
    with pytest.raises(EngineError, match="token ids"):
        engine.generate([[1, 99]], n=1, sampling=Sampling(1.0), max_new_tokens=2, seed=0)


def test_the_hf_engine_takes_the_shared_device_setting(model_dir):
    from pydantic import ValidationError

    for good in ("auto", "cpu", "cuda", "cuda:0"):
        assert ProducerConfig(device=good).device == good
    for bad in ("gpu", "cuda:x", ""):
        with pytest.raises(ValidationError, match="device"):
            ProducerConfig(device=bad)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    engine = HFEngine.from_dir(model_dir, device="auto", dtype="bfloat16")
    assert {(p.device.type, p.dtype) for p in engine.model.parameters()} == {(expected, torch.bfloat16)}
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="producer.device='cuda:1' but torch sees no CUDA device"):
            HFEngine.from_dir(model_dir, device="cuda:1")


def test_cut_at_stop_and_prompt_seeds():
    assert cut_at_stop([5, 2, 0, 0], [-1.0, -2.0, -3.0, -4.0], frozenset({2})) == Sample([5, 2], [-1.0, -2.0], "stop")
    assert cut_at_stop([5, 6], [-1.0, -2.0], frozenset({2})) == Sample([5, 6], [-1.0, -2.0], "length")
    seeds = {prompt_seed(s, i) for s in range(10) for i in range(10)}
    assert len(seeds) == 100 and all(0 <= x < 2**31 for x in seeds)


# ----------------------------------------------------------------------------------------------- step


def _untimed(rollouts: list[Rollout]) -> list[Rollout]:
    return [dataclasses.replace(r, timings={}) for r in rollouts]




@pytest.fixture(scope="module")
def tokenizer():
    from stream_rl.demo.tokenizer import build_tokenizer

    return build_tokenizer()


def test_step_builds_complete_groups_with_deterministic_ids_and_versions(tokenizer):
    engine = FakeEngine(tokenizer, version=4)
    prompts = [prompt_record(1), prompt_record(2, epoch=3, group_size=2)]
    result = produce_rollouts(prompts, engine, producer_id="producer-a", sampling=Sampling(0.9),
                              max_new_tokens=4, seed=0,
                              clock=lambda: 1001.0)
    got = [(r.rollout_id, r.group_id, r.sample_index, r.group_size) for r in result.rollouts]
    assert got == [(rollout_id_for("p1", 0, j), group_id_for("p1", 0), j, 3) for j in range(3)] + \
                  [(rollout_id_for("p2", 3, j), group_id_for("p2", 3), j, 2) for j in range(2)]
    assert [c[1] for c in engine.calls] == [2, 3]  # one generate call per group size
    for r in result.rollouts:
        encode(r)  # validates every wire rule
        assert r.token_policy_versions.tolist() == [4, 4] and r.token_policy_versions.dtype == np.int64
        assert r.response_token_ids.tolist() == [10 + r.sample_index, 2]
        assert r.behavior_logprobs.tolist() == [-0.5, -0.25] and r.temperature == 0.9
        assert r.prompt_token_ids.tolist() == tokenizer(r.prompt_text)["input_ids"]
        assert r.response_text == tokenizer.decode([10 + r.sample_index], skip_special_tokens=True)
        assert r.producer_id == "producer-a" and r.metadata == {"task": "add"} and r.finish_reason == "stop"
        assert r.timings["queue_wait_s"] == 1.0 and r.timings["created_at"] == 1001.0
    assert result.metrics["producer/rollouts"] == 5 and result.metrics["producer/policy_version"] == 4
    again = produce_rollouts(prompts, FakeEngine(tokenizer, 4), producer_id="producer-a", sampling=Sampling(0.9),
                             max_new_tokens=4, seed=0, clock=lambda: 1001.0)
    assert _untimed(again.rollouts) == _untimed(result.rollouts)


def test_step_group_size_override_and_seed_derivation(tokenizer):
    engine = FakeEngine(tokenizer)
    prompts = [prompt_record(1, group_size=3), prompt_record(2, group_size=5)]
    result = produce_rollouts(prompts, engine, producer_id="p", sampling=Sampling(1.0), max_new_tokens=4, seed=9,
                              group_size=2)
    assert len(engine.calls) == 1 and engine.calls[0][1] == 2
    assert [r.group_size for r in result.rollouts] == [2] * 4
    assert engine.calls[0][4] == batch_seed(9, prompts)
    assert batch_seed(9, prompts) != batch_seed(10, prompts)
    assert batch_seed(9, prompts) != batch_seed(9, [prompt_record(1, group_size=3, attempt=1), prompts[1]])


def test_step_rejects_unusable_prompts_and_keeps_the_rest(tokenizer):
    engine = FakeEngine(tokenizer)
    prompts = [prompt_record(1), prompt_record(2, text="hello"), prompt_record(3, text="1" * 20), prompt_record(4)]
    result = produce_rollouts(prompts, engine, producer_id="p", sampling=Sampling(1.0), max_new_tokens=4, seed=0)
    assert [(r.index, "tokenise" in r.reason or "exceeds" in r.reason) for r in result.rejected] == \
        [(1, True), (2, True)]
    assert "exceeds the model's 16" in result.rejected[1].reason
    assert sorted({r.prompt_id for r in result.rollouts}) == ["p1", "p4"]


def test_step_with_the_hf_engine_is_reproducible_and_valid(engine):
    prompts = [prompt_record(1), prompt_record(23, group_size=2)]
    kwargs = dict(producer_id="p", sampling=Sampling(1.0), max_new_tokens=6, seed=4)
    first = produce_rollouts(prompts, engine, **kwargs).rollouts
    second = produce_rollouts(prompts, engine, **kwargs).rollouts
    assert _untimed(first) == _untimed(second)
    for r in first:
        encode(r)
        assert r.response_text == engine.tokenizer.decode(r.response_token_ids.tolist(), skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------- loop (broker)










@pytest.mark.broker
def test_loop_turns_prompts_into_keyed_groups_and_commits(make_config, engine):
    from stream_rl.transport.client import Transport

    cfg = make_config(**{"topics.partitions": {"prompts": 2, "rollouts": 2}})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    pcfg = ProducerConfig(follow_weights=False, prompts_per_batch=3, max_new_tokens=6, poll_timeout_s=0.5)
    send_prompts(transport, [prompt_record(i, group_size=2) for i in range(5)] + [prompt_record(9, text="bad!")])
    thread, stop, stats, out = start_producer(cfg, pcfg, engine)
    first = collect(transport, transport.names.rollouts, want=10)
    wait_for(lambda: stats.prompts + stats.rejected_prompts == 6,
             'stats.prompts + stats.rejected_prompts == 6', 30.0, watch=[out])
    assert stop_producer(thread, stop, out).rollouts == 10
    rollouts = [c.value for c in first]
    assert sorted(r.rollout_id for r in rollouts) == sorted(rollout_id_for(f"p{i}", 0, j) for i in range(5)
                                                           for j in range(2))
    assert all(c.key == c.value.group_id.encode() for c in first)
    partition_of = {}
    for c in first:  # a group stays on one partition
        assert partition_of.setdefault(c.value.group_id, c.partition) == c.partition
    assert stats.rejected_prompts == 1
    # its telemetry: 6 prompts in (one rejected), 10 rollouts out, the response tokens, one timing per batch
    check_role_telemetry(cfg, transport, "producer", topic_in=transport.names.prompts, records_in=6,
                         topic_out=transport.names.rollouts, records_out=10,
                         tokens=sum(r.response_length for r in rollouts), stage="generate", batches=stats.batches)
    assert heartbeats(transport, only_export(cfg.run_dir)[0])[-1].step == stats.batches > 0  # step: batches

    # a restart in the same group reads only what is new: nothing of the first run is generated again
    send_prompts(transport, [prompt_record(7, epoch=1, group_size=2)])
    thread, stop, stats2, out = start_producer(cfg, pcfg, engine)
    wait_for(lambda: stats2.prompts == 1, 'stats2.prompts == 1', 30.0, watch=[out])
    wait_for(lambda: caught_up(transport, transport.names.group("producers"), transport.names.prompts),
             "the producers' commits at the end of every prompts partition", 30.0, watch=[out])  # nothing left to read
    assert stop_producer(thread, stop, out).prompts == 1
    every = [c.value.rollout_id for c in collect(transport, transport.names.rollouts, want=0)]  # all, stopped
    assert sorted(every) == sorted([r.rollout_id for r in rollouts] + [rollout_id_for("p7", 1, j) for j in range(2)])


@pytest.mark.broker
def test_loop_follows_verified_weights_and_keeps_its_version_on_a_corrupt_one(make_config, model_dir):
    from stream_rl.transport.client import Transport
    from stream_rl.weights import WeightsConfig
    from stream_rl.weights.publisher import WeightsPublisher

    cfg = make_config(**{"topics.partitions": {"prompts": 1, "rollouts": 1}})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    wcfg = WeightsConfig(mode="inline", chunk_size=200_000)
    sink = transport.sink()
    publisher = WeightsPublisher(transport, sink, wcfg, "trainer-0")
    v1 = publisher.publish(perturbed_state_dict(model_dir, seed=1), version=1, step=1)
    engine = HFEngine.from_dir(model_dir)
    pcfg = ProducerConfig(prompts_per_batch=4, max_new_tokens=4, poll_timeout_s=0.3, weights_startup_wait_s=10)
    thread, stop, stats, out = start_producer(cfg, pcfg, engine, weights_cfg=wcfg)
    try:
        send_prompts(transport, [prompt_record(1, group_size=2)])
        assert {int(v) for c in collect(transport, transport.names.rollouts, 2)
                for v in c.value.token_policy_versions} == {1}  # caught up before the first batch
        sink.send(transport.names.weights, dataclasses.replace(v1, version=2, sha256="0" * 64), key="2")
        sink.flush()
        wait_for(lambda: stats.rejected_versions == [2], 'stats.rejected_versions == [2]', 30.0, watch=[out])
        send_prompts(transport, [prompt_record(2, group_size=2)])
        wait_for(lambda: stats.rollouts == 4, 'stats.rollouts == 4', 30.0, watch=[out])
        assert engine.version == 1
        publisher.publish(perturbed_state_dict(model_dir, seed=3), version=3, step=3)
        wait_for(lambda: engine.version == 3, 'engine.version == 3', 30.0, watch=[out])
        send_prompts(transport, [prompt_record(3, group_size=2)])
        rollouts: list[Rollout] = [c.value for c in collect(transport, transport.names.rollouts, 6)]
    finally:
        final = stop_producer(thread, stop, out)
    versions = {r.prompt_id: set(r.token_policy_versions.tolist()) for r in rollouts}
    assert versions == {"p1": {1}, "p2": {1}, "p3": {3}}
    assert final.weight_updates == [1, 3] and final.rejected_versions == [2]


def _nudged(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` with one element in a hundred moved: a small optimizer step, which ships as a delta."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        mask = torch.rand(t.shape, generator=gen) < 0.01
        out[name] = torch.where(mask, t + 0.01, t) if t.is_floating_point() else t
    return out


@pytest.mark.broker
def test_loop_follows_delta_versions_bit_for_bit_and_rejects_a_corrupt_delta(make_config, model_dir):
    from stream_rl.transport.client import Transport
    from stream_rl.weights import WeightsConfig
    from stream_rl.weights.publisher import WeightsPublisher

    cfg = make_config(**{"topics.partitions": {"prompts": 1, "rollouts": 1}})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    wcfg = WeightsConfig(mode="inline", chunk_size=200_000, snapshot_every=8)
    sink = transport.sink()
    publisher = WeightsPublisher(transport, sink, wcfg, "trainer-0")
    states = {1: perturbed_state_dict(model_dir, seed=1)}
    states[2] = _nudged(states[1], seed=2)
    states[4] = _nudged(states[2], seed=4)
    v1 = publisher.publish(states[1], version=1, step=1)
    v2 = publisher.publish(states[2], version=2, step=2)
    assert v2.is_delta and v2.sent_bytes < 0.1 * v2.total_bytes
    engine = HFEngine.from_dir(model_dir)
    pcfg = ProducerConfig(prompts_per_batch=4, max_new_tokens=4, poll_timeout_s=0.3, weights_startup_wait_s=10)
    thread, stop, stats, out = start_producer(cfg, pcfg, engine, weights_cfg=wcfg)
    try:
        wait_for(lambda: engine.version == 2,
                 'engine.version == 2', 30.0, watch=[out])  # v1 full, then v2 rebuilt from it
        bad = dataclasses.replace(v2, version=3, delta_base=2, delta_base_sha256=v2.sha256, sha256="0" * 64)
        sink.send(transport.names.weights, bad, key="3")  # v2's delta bytes applied to v2: not what "v3" says
        sink.flush()
        wait_for(lambda: stats.rejected_versions == [3], 'stats.rejected_versions == [3]', 30.0, watch=[out])
        assert engine.version == 2
        v4 = publisher.publish(states[4], version=4, step=4)  # a delta against v2, the last acknowledged version
        assert v4.delta_base == 2
        wait_for(lambda: engine.version == 4, 'engine.version == 4', 30.0, watch=[out])
        send_prompts(transport, [prompt_record(1, group_size=2)])
        rollouts = [c.value for c in collect(transport, transport.names.rollouts, 2)]
    finally:
        final = stop_producer(thread, stop, out)
    assert {int(v) for r in rollouts for v in r.token_policy_versions} == {4}
    assert final.weight_updates == [2, 4]  # v2 rebuilt from snapshot v1 at start-up, then v4 from the held v2
    assert final.rejected_versions == [3] and v1.delta_base is None
    held = engine.model.state_dict()
    for name, tensor in states[4].items():  # the engine runs exactly the trainer's bytes
        assert torch.equal(held[name], tensor), name
