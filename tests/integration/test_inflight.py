"""In-flight weight updates (issue 15): the hf engine swaps weights between decode steps and every token records
the version that produced it; the step, the producer loop's hook and the trainer's staleness follow the tokens."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from support.producers import (
    PROMPTS,
    TEMPERATURE,
    FakeEngine,
    build_tiny_model_dir,
    perturbed_state_dict,
    prompt_record,
    reference_model,
    swap_errors,
)

from producers.config import ProducerConfig
from producers.engines.base import EngineError, Sample, Sampling
from producers.engines.hf import HFEngine
from producers.step import produce_rollouts

torch.set_num_threads(1)

START = 3  # the version the engine holds when the generation starts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-inflight") / "policy")


@pytest.fixture(scope="module")
def new_weights(model_dir) -> dict[str, torch.Tensor]:
    return perturbed_state_dict(model_dir, scale=0.5, seed=7)


def _engine(model_dir: Path) -> HFEngine:
    return HFEngine.from_dir(model_dir, version=START)


def _swap_on_call(engine: HFEngine, state: dict[str, torch.Tensor], call: int, calls: list[int]):
    """A hook that loads ``state`` as version START + 1 on its ``call``-th call (1-based); records the calls."""

    def hook() -> None:
        calls.append(engine.version)
        if len(calls) == call:
            engine.load_weights(state, START + 1)

    return hook








# ----------------------------------------------------------------------------------------------- hf engine
def test_tokens_from_the_swap_on_carry_the_new_version_and_its_logprobs(model_dir, new_weights):
    """every=3, the hook loads v4 on its 2nd call, i.e. before token k=6: tokens 0..5 carry v3, 6.. carry v4.
    Tokens before k match a full forward of the old weights; tokens from k on match the new weights run on the old
    weights' cache (the engine's approximation), and neither the old weights nor a full forward of the new ones
    (other conditioning) reproduces them, so the check can fail."""
    engine, calls, k = _engine(model_dir), [], 6
    engine.set_weights_hook(_swap_on_call(engine, new_weights, 2, calls), every=3)
    groups = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=5)
    assert engine.version == START + 1 and calls[:2] == [START, START] and set(calls[2:]) <= {START + 1}
    old, new = reference_model(model_dir), reference_model(model_dir, new_weights)
    errors = swap_errors(old, new, PROMPTS, groups, k, START)
    assert errors.before.max() < 1e-4 and errors.after.max() < 1e-4






def test_with_the_switch_off_or_nothing_new_the_samples_are_identical(model_dir):
    """No hook: ``token_versions`` is None and the samples are what they always were (the contract test against
    transformers' generate in test_producers.py runs this path unchanged). A hook that loads nothing changes no
    token and no logprob, bit for bit, and stamps every token with the version held."""
    plain = _engine(model_dir).generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=9)
    engine, calls = _engine(model_dir), []
    engine.set_weights_hook(lambda: calls.append(1), every=2)
    hooked = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=9)
    assert calls  # the hook ran
    for a, b in zip((s for g in plain for s in g), (s for g in hooked for s in g), strict=True):
        assert a.token_versions is None and b.token_versions == [START] * len(b.token_ids)
        assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
    engine.set_weights_hook(None, 0)
    again = engine.generate(PROMPTS, n=4, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=9)
    assert again == plain  # hook removed: the plain path again (token_versions None)


@pytest.mark.parametrize("every", [1, 3, 4, 11])
def test_the_hook_runs_only_every_n_decode_steps(model_dir, every):
    """Counting the model's forwards (1 prefill + 1 per decode step): the j-th hook call comes right before the
    forward that computes token j*every, i.e. after j*every forwards; none after the last token."""
    engine, seen = _engine(model_dir), []
    forwards = [0]
    handle = engine.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        engine.set_weights_hook(lambda: seen.append(forwards[0]), every=every)
        groups = engine.generate(PROMPTS, n=2, sampling=Sampling(TEMPERATURE), max_new_tokens=10, seed=1)
    finally:
        handle.remove()
    steps = max(len(s.token_ids) for g in groups for s in g)  # decode steps the loop ran
    assert forwards[0] == steps  # prefill (token 0) + one forward per later token
    assert seen == [j * every for j in range(1, (steps - 1) // every + 1)]


def test_a_hook_needs_a_positive_interval_and_engines_without_support_refuse_it(model_dir, tokenizer):
    with pytest.raises(EngineError, match="every >= 1"):
        _engine(model_dir).set_weights_hook(lambda: None, every=0)
    with pytest.raises(EngineError, match="producer.inflight_updates"):
        FakeEngine(tokenizer).set_weights_hook(lambda: None, every=8)
    FakeEngine(tokenizer).set_weights_hook(None, 0)  # clearing is always allowed


# ----------------------------------------------------------------------------------------------- config
def test_config_refuses_inflight_updates_it_cannot_do():
    assert ProducerConfig().inflight_updates is False and ProducerConfig().inflight_check_every == 8
    assert ProducerConfig(inflight_updates=True, inflight_check_every=4).inflight_check_every == 4
    assert ProducerConfig(inflight_updates=True, engine="vllm").inflight_updates  # tests/integration/test_vllm_engine.py
    with pytest.raises(ValueError, match="producer.inflight_updates = true needs producer.follow_weights"):
        ProducerConfig(inflight_updates=True, follow_weights=False)
    with pytest.raises(ValueError):
        ProducerConfig(inflight_check_every=0)


# ----------------------------------------------------------------------------------------------- step and loop
@pytest.fixture(scope="module")
def tokenizer():
    from stream_rl.demo.tokenizer import build_tokenizer

    return build_tokenizer()


class _SwappingEngine(FakeEngine):
    """Sample j = [10 + j, 11, 12, eos]; the weights move from v3 to v4 before token 2 of the first call."""

    def generate(self, prompt_token_ids, n, sampling, max_new_tokens, seed):
        start, self._version = self._version, self._version + (not self.calls)
        self.calls.append(seed)
        versions = [start, start, self._version, self._version]
        return [[Sample([10 + j, 11, 12, 2], [-0.5] * 4, "stop", versions) for j in range(n)]
                for _ in prompt_token_ids]


def test_step_writes_each_tokens_version_and_reports_the_version_it_ends_with(tokenizer):
    prompts = [prompt_record(0, group_size=2), prompt_record(1, group_size=2), prompt_record(2, group_size=3)]  # two generate calls
    result = produce_rollouts(prompts, _SwappingEngine(tokenizer, version=3), producer_id="p", sampling=Sampling(1.0),
                              max_new_tokens=4, seed=0)
    versions = [r.token_policy_versions.tolist() for r in result.rollouts]
    assert versions == [[3, 3, 4, 4]] * 4 + [[4, 4, 4, 4]] * 3  # the second call started on v4
    assert all(r.token_policy_versions.dtype == np.int64 for r in result.rollouts)
    m = result.metrics
    assert m["producer/policy_version"] == 4.0 and m["producer/inflight_updates"] == 1.0
    assert m["producer/mixed_version_fraction"] == pytest.approx(4 / 7)
    plain = produce_rollouts(prompts, FakeEngine(tokenizer, version=3), producer_id="p", sampling=Sampling(1.0),
                             max_new_tokens=4, seed=0)
    assert all(r.token_policy_versions.tolist() == [3, 3] for r in plain.rollouts)  # token_versions None
    assert plain.metrics["producer/inflight_updates"] == 0.0 and plain.metrics["producer/policy_version"] == 3.0


def test_the_loops_hook_loads_through_the_follower_and_keeps_the_books(tokenizer):
    """The hook is one follower update (non-blocking poll, then fetch + verify + load); a version change counts
    in ProducerStats.inflight_updates and moves the version the telemetry reports."""
    from producers.weights_follower import ProducerStats, inflight_hook

    engine = FakeEngine(tokenizer, version=3)

    class Follower:
        updates = 0

        def update(self, timeout_s: float = 0.0, wait_for_newer: bool = False) -> None:
            assert (timeout_s, wait_for_newer) == (0.0, False)  # never waits inside a generation
            self.updates += 1
            if self.updates == 2:
                engine._version = 4  # what WeightsFollower.load does through engine.load_weights

    class Telemetry:
        versions: list[int] = []

        def set_version(self, version: int) -> None:
            self.versions.append(version)

    stats, follower, telemetry = ProducerStats(), Follower(), Telemetry()
    hook = inflight_hook(follower, engine, telemetry, stats)
    for _ in range(3):
        hook()
    assert follower.updates == 3 and stats.inflight_updates == 1 and telemetry.versions == [4]


@pytest.mark.broker
def test_the_loop_loads_a_version_published_during_a_generation_between_decode_steps(make_config, model_dir,
                                                                                  new_weights):
    """v1 is published once the producer's first generation has begun (nothing else can load it before the batch
    ends): the hook picks it up at a multiple of inflight_check_every, every rollout of the batch switches from v0
    to v1 at that same token, the books count one in-flight update, and the hook is cleared when the loop ends."""
    from support.producers import collect, send_prompts, start_producer, stop_producer

    from stream_rl.transport.client import Transport
    from stream_rl.weights import WeightsConfig
    from stream_rl.weights.publisher import WeightsPublisher

    cfg = make_config(**{"topics.partitions": {"prompts": 1, "rollouts": 1}, "kafka.fetch_max_wait_ms": 100})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    wcfg = WeightsConfig(mode="inline", chunk_size=200_000)
    publisher = WeightsPublisher(transport, transport.sink(), wcfg, "trainer-0")

    class PublishingEngine(HFEngine):
        published = False

        def generate(self, *args, **kwargs):
            if not self.published:  # the between-batch look already ran: only the in-flight hook can see v1
                self.published = True
                publisher.publish(new_weights, version=1, step=1)
                time.sleep(0.5)  # > kafka.fetch_max_wait_ms: the manifest reaches the producer's reader
            return super().generate(*args, **kwargs)

    engine, every = PublishingEngine.from_dir(model_dir), 2
    pcfg = ProducerConfig(prompts_per_batch=2, max_new_tokens=24, poll_timeout_s=0.3, weights_startup_wait_s=0.2,
                          inflight_updates=True, inflight_check_every=every)
    thread, stop, stats, out = start_producer(cfg, pcfg, engine, weights_cfg=wcfg)
    try:
        send_prompts(transport, [prompt_record(1, group_size=4), prompt_record(2, group_size=4)])
        rollouts = [c.value for c in collect(transport, transport.names.rollouts, 8)]
    finally:
        final = stop_producer(thread, stop, out)
    assert len(rollouts) == 8 and engine.published
    assert final.inflight_updates == 1 and final.weight_updates == [1] and final.version == engine.version == 1
    switch = {int(np.argmax(r.token_policy_versions)) for r in rollouts if r.max_policy_version == 1}
    (k,) = switch  # one batch, one swap: the same token index in every rollout that reached it
    assert k > 0 and k % every == 0
    for r in rollouts:
        n = r.response_length
        assert r.token_policy_versions.tolist() == [0] * min(n, k) + [1] * max(0, n - k)
    assert engine._hook is None  # cleared on exit: a reused engine never calls into the closed receiver


# ----------------------------------------------------------------------------------------------- trainer side
def test_a_rollout_with_mixed_versions_is_as_stale_as_its_oldest_token():
    """Tokens [3, 3, 4, 4] at trainer version 5: lag 5 - 3 = 2 (rollout_lag and policy_lag agree), so max_lag 1
    drops it and max_lag 2 keeps it; per token the lags are [2, 2, 1, 1] (mean 1.5); it is not on policy at v4
    even though its last tokens are; the off-policy weights stay per token (behaviour logprobs aligned)."""
    from support.trainer import TOPIC, Rec, scored

    from consumers.trainer.batcher import Batcher, rollout_lag
    from consumers.trainer.rollout_metrics import rollout_metrics
    from consumers.trainer.tensors import build_batch
    from consumers.trainer.train_step import on_policy_mismatch
    from stream_rl.algorithms import importance_weights, policy_lag

    mixed = scored(0, 0, group_size=1, response_ids=[6, 7, 8, 9], versions=[3, 3, 4, 4],
                   behavior=[-0.5, -1.0, -1.5, -2.0])
    assert rollout_lag(mixed, 5) == 2 and rollout_lag(mixed, 4) == 1
    batch = build_batch([mixed])
    assert batch.token_versions[0, :4].tolist() == [3, 3, 4, 4]
    assert policy_lag(batch.token_versions, batch.response_mask, 5).tolist() == [2]
    assert Batcher(max_lag=2).add(Rec(TOPIC, 0, 0, mixed), 5) == []
    (drop,) = Batcher(max_lag=1).add(Rec(TOPIC, 0, 0, mixed), 5)
    assert drop.stale[0].lag == 2 and "lag 2 > max_lag 1" in drop.stale[0].reason
    m = rollout_metrics([mixed, scored(1, 0, group_size=1, response_ids=[6, 7], version=5)], 5, 1.0)
    assert m["staleness/mean_lag"] == 1.0  # (2 + 0) / 2, by the oldest token
    assert m["staleness/token_mean_lag"] == pytest.approx((2 + 2 + 1 + 1 + 0 + 0) / 6)
    assert m["staleness/mixed_version_frac"] == 0.5
    mask = batch.response_mask
    prox = torch.tensor([[-0.5, -0.5, -0.5, -0.5]])
    assert on_policy_mismatch(batch.behavior_logp, prox, mask, batch.token_versions, 4) == \
        {"mismatch/on_policy_samples": 0.0}
    weights, _ = importance_weights(prox, batch.behavior_logp, mask)  # [1, T]: pi_prox / mu per token
    assert torch.allclose(weights[0, :4], torch.exp(torch.tensor([0.0, 0.5, 1.0, 1.5])))
