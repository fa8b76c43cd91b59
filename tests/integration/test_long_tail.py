"""No batch barrier (issue 31, item 3) on the tiny real Llama, float32: the hf engine hands each group over from
inside its decode loop at the step its last sample ended; the samples are bit for bit those of a call without the
hand-over; the producer's step gives each group to its sink once, as the same rollouts; the producer role on the
in-process bus publishes exactly what the batch barrier published, each rollout once."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.producers import PROMPTS, build_tiny_model_dir, prompt_record, send_prompts
from support.topics import caught_up, read_records

from producers.config import ProducerConfig
from producers.engines.base import Sampling
from producers.engines.hf import HFEngine
from producers.step import produce_rollouts

# token ids 3..12 end a sample too: the rows of a batch end at very different steps
SAMPLING = Sampling(temperature=1.0, stop_token_ids=list(range(3, 13)))
BUDGET = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("long_tail") / "policy")


@pytest.fixture(scope="module")
def engine(model_dir) -> HFEngine:
    return HFEngine.from_dir(model_dir)


class ForwardCounter:
    """Counts the real model's forward calls (prefill + one per decode step) through a forward hook."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def test_each_group_is_handed_over_at_the_step_its_last_sample_ended(engine):
    counter = ForwardCounter(engine.model)
    seen: list[tuple[int, int, list]] = []  # (prompt, forwards so far, samples)
    try:
        streamed = engine.generate(PROMPTS, 3, SAMPLING, BUDGET, seed=4,
                                   on_group=lambda b, samples: seen.append((b, counter.calls, samples)))
        total = counter.calls
    finally:
        counter.handle.remove()
    plain = engine.generate(PROMPTS, 3, SAMPLING, BUDGET, seed=4)
    assert streamed == plain  # the hand-over changes nothing: tokens, logprobs, finish reasons
    assert sorted(b for b, _, _ in seen) == list(range(len(PROMPTS)))  # each group once
    for b, calls, samples in seen:
        assert samples == plain[b]
        longest = max(len(s.token_ids) for s in samples)  # token j is drawn after j + 1 forwards
        assert calls == longest, (b, calls, longest)
    longest_batch = max(len(s.token_ids) for g in plain for s in g)
    assert total == longest_batch  # the loop ends with the batch's longest sample
    early = [calls for _, calls, _ in seen if calls < total]
    assert early, "no group ended before the batch's longest sample: the case does not test the barrier"
    assert [calls for _, calls, _ in seen] == sorted(calls for _, calls, _ in seen)  # in order of completion


def test_the_step_hands_every_group_to_its_sink_once_as_the_rollouts_it_returns(engine):
    prompts = [prompt_record(i, group_size=3) for i in range(5)]
    groups: list[list] = []
    kw = {"producer_id": "p0", "sampling": SAMPLING, "max_new_tokens": BUDGET, "seed": 1}
    result = produce_rollouts(prompts, engine, on_group=groups.append, **kw)
    barrier = produce_rollouts(prompts, engine, **kw)
    assert len(groups) == 5
    assert all(len({r.group_id for r in g}) == 1 and [r.sample_index for r in g] == [0, 1, 2] for g in groups)
    by_id = {r.rollout_id: r for g in groups for r in g}
    assert sorted(by_id) == sorted(r.rollout_id for r in result.rollouts)
    assert all(by_id[r.rollout_id] is r for r in result.rollouts)  # the same objects: nothing built twice
    for got, want in zip(result.rollouts, barrier.rollouts, strict=True):
        assert got.rollout_id == want.rollout_id
        assert got.response_token_ids.tolist() == want.response_token_ids.tolist()
        assert got.behavior_logprobs.tolist() == want.behavior_logprobs.tolist()
    # handed over as they completed: a group's generation time is at most the whole batch's
    assert all(g[0].timings["generate_s"] <= result.metrics["producer/generate_s"] + 1e-9 for g in groups)


@pytest.mark.parametrize("stream", [True, False])
def test_the_producer_publishes_each_rollout_once_streamed_or_not(stream, engine, tmp_path, run_name):
    from support.memory_bus import memory_config
    from stream_rl.transport.client import Transport
    from support.producers import start_producer, stop_producer
    from support.waiting import wait_for

    cfg = memory_config(run_name, tmp_path / "run")
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    send_prompts(transport, [prompt_record(i, group_size=3) for i in range(4)])
    pcfg = ProducerConfig(follow_weights=False, prompts_per_batch=4, max_new_tokens=BUDGET, poll_timeout_s=0.2,
                          stop_token_ids=SAMPLING.stop_token_ids, stream_groups=stream, seed=2)
    thread, stop, stats, out = start_producer(cfg, pcfg, engine)
    wait_for(lambda: stats.rollouts == 12, "stats.rollouts == 12", 60.0, watch=[out])
    stop_producer(thread, stop, out)
    records = read_records(transport, transport.names.rollouts, "rollout")
    ids = [r.value.rollout_id for r in records]
    assert len(ids) == len(set(ids)) == 12  # each once, none lost
    assert all(r.key == r.value.group_id.encode() for r in records)
    reference = produce_rollouts([prompt_record(i, group_size=3) for i in range(4)], engine, producer_id="x",
                                 sampling=pcfg.sampling(), max_new_tokens=BUDGET, seed=2)
    tokens = {r.rollout_id: r.response_token_ids.tolist() for r in reference.rollouts}
    assert {r.value.rollout_id: r.value.response_token_ids.tolist() for r in records} == tokens


def test_stream_groups_is_on_by_default():
    assert ProducerConfig().stream_groups is True
    assert ProducerConfig(stream_groups=False).stream_groups is False


def test_a_stopped_loop_returns_the_ended_groups_unchanged_and_the_rest_empty(engine):
    prompts = PROMPTS * 2  # 6 groups
    full = engine.generate(prompts, 3, SAMPLING, BUDGET, seed=4)
    calls: list[list[bool]] = []

    def stop_when(ended: list[bool]) -> bool:  # stop at the first step with 2 groups complete
        calls.append(list(ended))
        return sum(ended) >= 2

    cut = engine.generate(prompts, 3, SAMPLING, BUDGET, seed=4, stop_when=stop_when)
    ended = calls[-1]
    assert sum(ended) >= 2 and not all(ended)  # it did stop early
    for b in range(len(prompts)):
        assert cut[b] == (full[b] if ended[b] else [])  # same RNG stream up to the stop: the same samples


def test_the_step_aborts_the_tail_and_the_producer_regenerates_it(engine, tmp_path, run_name):
    from producers.step import EarlyStop
    from support.memory_bus import memory_config
    from stream_rl.transport.client import Transport
    from support.producers import start_producer, stop_producer
    from support.waiting import wait_for

    prompts = [prompt_record(i, group_size=3) for i in range(6)]
    kw = {"producer_id": "p0", "sampling": SAMPLING, "max_new_tokens": BUDGET, "seed": 3}
    result = produce_rollouts(prompts, engine, early_stop=EarlyStop(oversample=1.0), **kw)
    assert 1 <= len(result.aborted) <= 3  # ceil(6 / 2) = 3 groups at least were complete
    assert result.metrics["producer/aborted"] == len(result.aborted)
    kept = {r.prompt_id for r in result.rollouts}
    assert kept.isdisjoint(f"p{i}" for i in result.aborted) and len(kept) == 6 - len(result.aborted)
    assert len(result.rollouts) == 3 * len(kept)  # only whole groups, nothing partial
    protected = produce_rollouts(prompts, engine, early_stop=EarlyStop(1.0, None, frozenset(result.aborted)), **kw)
    assert set(result.aborted) <= {int(r.prompt_id[1:]) for r in protected.rollouts}  # protected: run to the end

    cfg = memory_config(run_name, tmp_path / "run")
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    send_prompts(transport, prompts)
    pcfg = ProducerConfig(follow_weights=False, prompts_per_batch=6, max_new_tokens=BUDGET, poll_timeout_s=0.2,
                          stop_token_ids=SAMPLING.stop_token_ids, seed=3, oversample=1.0)
    thread, stop, stats, out = start_producer(cfg, pcfg, engine)
    wait_for(lambda: stats.rollouts == 18, "stats.rollouts == 18", 60.0, watch=[out])
    wait_for(lambda: caught_up(transport, transport.names.group("producers"), transport.names.prompts),
             "the producers' commits at the end of the prompts", 30.0, watch=[out])  # the carried ones too
    stop_producer(thread, stop, out)
    assert stats.batches >= 2  # the aborted prompts came back in a later batch
    records = read_records(transport, transport.names.rollouts, "rollout")
    ids = [r.value.rollout_id for r in records]
    assert len(ids) == len(set(ids)) == 18  # every prompt's group once, none lost, none partial
