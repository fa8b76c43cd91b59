"""Producer defects found by the kill -9 and fuzz storms: the backpressure deadlock after a crash recovery, the
fallback to the newest verified weights, poison prompts (group_size 1e9) and heartbeats' batch counter.

Pure tests of the budget and the batch plan first, then the loop on the real broker."""

from __future__ import annotations

import dataclasses
import logging
import time

import msgpack
import pytest
import torch
from support.producers import (
    build_tiny_model_dir,
    collect,
    perturbed_state_dict,
    prompt_record,
    send_prompts,
    start_producer,
    stop_producer,
)
from support.topics import heartbeats, read_records, read_values
from support.waiting import wait_for

from producers.budget import Budget
from producers.config import ProducerConfig
from producers.engines.hf import HFEngine
from producers.step import check_prompts, plan_batch
from schemas import DeadLetter, Prompt, StaleRollout, group_id_for, rollout_id_for
from schemas.validation import message_to_wire

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------------- budget (pure)
def _members(group_id: str, n: int) -> list[str]:
    return [group_id] * n  # the trainer writes one stale record per member of a dropped group


def test_recovery_case_stale_groups_come_back_and_generation_resumes():
    """The 4 min 35 s deadlock: a full budget of groups is dropped as stale after a trainer resume, no new version
    comes until fresh groups are trained, so the producer must generate again from the drops alone."""
    budget = Budget(share=4, versions_ahead=1, start_version=5)
    groups = {f"p{i}:0": 2 for i in range(8)}
    budget.charge(groups)  # (5 - 5 + 1 + 1) * 4 = 8 groups allowed at v5
    assert budget.over(5, now=0.0)
    assert budget.returned_stale([g for g in groups for _ in range(2)]) == 8  # 16 records, 8 drops
    assert budget.in_flight == 0 and not budget.over(5, now=1.0)
    budget.charge({f"p{i}:0": 2 for i in range(8)})  # the re-queued prompts, generated again
    assert budget.over(5, now=2.0)
    assert not budget.over(6, now=3.0)  # a new version opens one more share, as before


def test_one_drop_returns_one_group_and_foreign_groups_return_nothing():
    budget = Budget(share=2, versions_ahead=0, start_version=0)
    budget.charge({"a:0": 3, "b:0": 3})
    assert budget.returned_stale(_members("a:0", 3)) == 1  # its 3 member records are one drop
    assert budget.returned_stale(_members("a:0", 3) + ["zz:0"]) == 0  # nothing of a is in flight; zz is not ours
    budget.charge({"a:0": 3})  # attempt 1 of a
    budget.charge({"a:0": 3})  # ... and attempt 2 before the drop of attempt 1 was read
    assert budget.returned_stale(_members("a:0", 3) + _members("a:0", 3)) == 2
    assert (budget.generated, budget.returned, budget.in_flight) == (4, 3, 1)


def test_a_stalled_budget_is_re_derived_after_the_timeout_and_a_new_version_restarts_the_clock():
    budget = Budget(share=1, versions_ahead=0, start_version=3, stall_timeout_s=10.0)
    budget.charge({"a:0": 2, "b:0": 2, "c:0": 2})
    assert budget.over(3, now=100.0) and budget.over(4, now=105.0)  # allowed 1, then 2: still over
    assert budget.over(4, now=114.0)  # 9 s at v4: the clock restarted at v4
    assert not budget.over(4, now=115.0)  # 10 s at v4: re-derived from v4, nothing in flight
    assert (budget.resets, budget.start_version, budget.in_flight) == (1, 4, 0)
    assert budget.returned_stale(_members("a:0", 2)) == 0  # groups from before the reset are forgotten
    assert not Budget(share=None, versions_ahead=0, start_version=0).over(0, now=0.0)


def test_budget_state_stays_bounded():
    budget = Budget(share=2, versions_ahead=1, start_version=0)
    budget.charge({f"p{i}:0": 2 for i in range(10_000)})
    assert len(budget._groups) == 64  # max(64, 8 shares * 2 * 2)
    assert budget.returned_stale(_members("p0:0", 2)) == 0 and budget.returned_stale(_members("p9999:0", 2)) == 1


# ----------------------------------------------------------------------------------------------- batch plan (pure)
def test_rejected_runs_are_taken_alone_before_anything_after_them_is_generated():
    parts = ["p0", "p0", "p0", "p0", "p0", "p1", "p1", "p1"]  # p0: R R A A R   p1: A A A
    first = plan_batch(parts, rejected={0, 1, 4})
    assert (first.reject, first.generate, first.carry) == ([0, 1], [], [2, 3, 4, 5, 6, 7])
    second = plan_batch(["p0", "p0", "p0", "p1", "p1", "p1"], rejected={2})  # the carry: A A R | A A A
    assert (second.reject, second.generate, second.carry) == ([], [0, 1, 3, 4, 5], [2])
    assert plan_batch(["p0"], rejected={0}).reject == [0]
    assert plan_batch(["p0", "p1"], rejected=set()).generate == [0, 1]


def test_group_sizes_above_the_bound_are_rejected_with_the_reason(model_dir):
    engine = HFEngine.from_dir(model_dir)
    prompts = [prompt_record(0, group_size=5), prompt_record(1, group_size=4), prompt_record(2, group_size=10**9)]
    accepted, rejected = check_prompts(prompts, engine, max_new_tokens=4, max_group_size=4)
    assert [i for i, _, _ in accepted] == [1]
    assert [(r.index, r.reason) for r in rejected] == [
        (0, "prompt group_size 5 exceeds producer.max_group_size 4"),
        (2, "prompt group_size 1000000000 exceeds producer.max_group_size 4")]
    _, rejected = check_prompts(prompts[1:2], engine, max_new_tokens=4, group_size=8, max_group_size=4)
    assert rejected[0].reason == "producer.group_size 8 exceeds producer.max_group_size 4"
    with pytest.raises(ValueError, match="producer.group_size=300 exceeds producer.max_group_size=256"):
        ProducerConfig(group_size=300)


# ----------------------------------------------------------------------------------------------- loop (broker)
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "policy")


def _stale(prompt: Prompt) -> list[StaleRollout]:
    return [StaleRollout(rollout_id=rollout_id_for(prompt.prompt_id, prompt.epoch, i), prompt_id=prompt.prompt_id,
                         epoch=prompt.epoch, group_id=group_id_for(prompt.prompt_id, prompt.epoch),
                         reason="lag 3 > max_lag 1", lag=3, max_lag=1, trainer_version=4, requeued=True)
            for i in range(prompt.group_size)]


@pytest.mark.broker
def test_producer_over_budget_resumes_when_the_trainer_drops_its_groups_as_stale(make_config, model_dir):
    from stream_rl.transport.client import Transport
    from stream_rl.weights import WeightsConfig

    cfg = make_config(**{"topics.partitions": {"prompts": 1, "rollouts": 1}})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    pcfg = ProducerConfig(prompts_per_batch=2, max_new_tokens=4, poll_timeout_s=0.3, weights_startup_wait_s=0,
                          max_groups_per_version=2, versions_ahead=0, backpressure_timeout_s=None)
    first = [prompt_record(i, group_size=2) for i in range(2)]
    send_prompts(transport, first)
    thread, stop, stats, out = start_producer(cfg, pcfg, HFEngine.from_dir(model_dir), weights_cfg=WeightsConfig())
    try:
        wait_for(lambda: stats.groups == 2,
                 'stats.groups == 2', 30.0, watch=[out])  # its whole budget at v0: no trainer publishes a new version
        send_prompts(transport, [prompt_record(i, group_size=2) for i in range(2, 4)])
        time.sleep(2.0)
        assert stats.groups == 2, "over budget: must wait"
        sink = transport.sink()  # the trainer resumes and drops both groups as stale
        for record in _stale(first[0]) + _stale(first[1]):
            sink.send(transport.names.stale, record, key=record.group_id)
        sink.flush()
        sink.close()
        started = time.monotonic()
        wait_for(lambda: stats.groups == 4, 'stats.groups == 4', 15.0, watch=[out])
        resumed_s = time.monotonic() - started
    finally:
        final = stop_producer(thread, stop, out)
    assert final.groups_returned == 2 and final.budget_resets == 0
    assert resumed_s < 15.0
    assert sorted({r.value.prompt_id for r in collect(transport, transport.names.rollouts, 8)}) == [
        "p0", "p1", "p2", "p3"]


@pytest.mark.broker
def test_producer_falls_back_to_the_newest_verified_version(make_config, model_dir, caplog):
    from stream_rl.transport.client import Transport
    from stream_rl.weights import WeightsConfig
    from stream_rl.weights.publisher import WeightsPublisher

    cfg = make_config(**{"topics.partitions": {"prompts": 1, "rollouts": 1}})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    wcfg = WeightsConfig(mode="inline", chunk_size=200_000)
    sink = transport.sink()
    publisher = WeightsPublisher(transport, sink, wcfg, "trainer-0")
    publisher.publish(perturbed_state_dict(model_dir, seed=1), version=1, step=1)
    v2 = publisher.publish(perturbed_state_dict(model_dir, seed=2), version=2, step=2)
    sink.send(transport.names.weights, dataclasses.replace(v2, version=3, step=3, sha256="0" * 64), key="3")
    sink.flush()  # v3: a manifest whose payload digest matches nothing
    engine = HFEngine.from_dir(model_dir)
    pcfg = ProducerConfig(prompts_per_batch=2, max_new_tokens=4, poll_timeout_s=0.3, weights_startup_wait_s=10)
    caplog.set_level(logging.WARNING, logger="producers.role")
    thread, stop, stats, out = start_producer(cfg, pcfg, engine, weights_cfg=wcfg)
    try:
        send_prompts(transport, [prompt_record(1, group_size=2)])
        rollouts = [c.value for c in collect(transport, transport.names.rollouts, 2)]
    finally:
        final = stop_producer(thread, stop, out)
    assert engine.version == 2 and final.weight_updates == [2] and final.rejected_versions == [3]
    assert {int(v) for r in rollouts for v in r.token_policy_versions} == {2}
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("rejected weights v3 (WeightsError: weights v3: ") for m in messages)
    assert "weights v3 rejected: falling back to v2" in messages


class _CrashOnce:
    """The engine, except that its first ``generate`` dies (a producer killed in the middle of a batch)."""

    def __init__(self, engine):
        self._engine, self.crashed = engine, False

    def generate(self, *args, **kwargs):
        if not self.crashed:
            self.crashed = True
            raise RuntimeError("killed while generating")
        return self._engine.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.broker
def test_poison_prompts_are_dead_lettered_once_across_a_crash_and_a_restart(make_config, model_dir):
    from stream_rl.transport.client import Transport

    cfg = make_config(**{"topics.partitions": {"prompts": 1, "rollouts": 1}})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    pcfg = ProducerConfig(follow_weights=False, prompts_per_batch=8, max_new_tokens=4, poll_timeout_s=0.3,
                          max_group_size=4)
    send_prompts(transport, [prompt_record(0, group_size=5), prompt_record(1, group_size=2), prompt_record(2, group_size=6),
                              prompt_record(3, group_size=2)])  # p0 and p2 above the producer's bound
    engine = HFEngine.from_dir(model_dir)
    thread, stop, stats, out = start_producer(cfg, pcfg, _CrashOnce(engine))
    thread.join(30)
    assert isinstance(out.get("error"), RuntimeError)  # died generating p1, after p0 was dead-lettered
    letters = read_values(transport, transport.names.dlq, "dead_letter")
    assert [(d.source_offset, d.error_type) for d in letters] == [(0, "PromptRejected")]

    thread, stop, stats, out = start_producer(cfg, pcfg, engine)  # the restart goes on from p1
    try:
        wait_for(lambda: stats.prompts == 2, 'stats.prompts == 2', 30.0, watch=[out])
        sink = transport.sink()  # then a prompt asking for 1e9 samples (raw: whichever check rejects it)
        huge = prompt_record(4, group_size=10**9)
        sink.send_raw(transport.names.prompts, msgpack.packb(message_to_wire(huge), use_bin_type=True), key="p4")
        sink.flush()
        sink.close()
        send_prompts(transport, [prompt_record(5, group_size=2)])
        wait_for(lambda: stats.prompts == 3, 'stats.prompts == 3', 30.0, watch=[out])
    finally:
        final = stop_producer(thread, stop, out)
    letters: list[DeadLetter] = read_values(transport, transport.names.dlq, "dead_letter")
    assert sorted(d.source_offset for d in letters) == [0, 2, 4]  # each poison prompt once, across both runs
    assert all("group_size" in d.reason for d in letters), [d.reason for d in letters]
    assert sorted({r.value.prompt_id for r in read_records(transport, transport.names.rollouts, "rollout")}) == [
        "p1", "p3", "p5"]
    assert final.batches >= 2
    # heartbeats report the batch counter in `step` (docs/wire-format.md)
    beats = [b for b in read_values(transport, transport.names.status, "heartbeat") if b.role == "producer"]
    last = heartbeats(transport, max(beats, key=lambda b: b.created_at).instance_id)[-1]
    assert last.state == "stopping" and last.step == final.batches
