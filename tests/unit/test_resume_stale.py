"""Issue 35.3 on the in-process bus: the versions a resumed trainer publishes widen no producer's backpressure budget.

The cause of the stale tail after a crash-resume: a trainer killed after publishing versions past its last complete
checkpoint resumes from that checkpoint and republishes its weights under the next number (``versions.reconcile``:
102 -> 107), while re-reading what it had trained since the checkpoint. The producers counted the republished version
as five more trained versions, so about five versions' worth of groups more stayed in flight for the rest of the
run, trained at lag up to ``max_lag`` + 5: ~28 % dropped as stale (1,452 of 5,216), long after the kill. Here a real
producer follows the exact manifest sequence such a crash leaves on the weights topic (versions and trainer steps,
published with the trainer's own publisher) and its in-flight groups are counted against the trained line. The
budget's arithmetic is unit-tested with hand-computed values in tests/unit/test_resume_stale_budget.py.

Moved from tests/integration (same assertions). Where it slept for "several iterations over budget", it now reads
the version each group was generated at (every rollout carries it): the producer decides whether to generate right
after loading a version, before it can load the next one, so a group the budget wrongly allowed at v4..v6 would
carry that version."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from support.producers import prompt_record, send_prompts, start_producer, stop_producer
from support.topics import read_records
from support.waiting import wait_for

from producers.config import ProducerConfig
from producers.engines.hf import HFEngine
from stream_rl.transport.client import Transport
from stream_rl.weights import WeightsConfig
from stream_rl.weights.publisher import WeightsPublisher

GROUP = 2


def _groups(transport) -> int:
    return len(read_records(transport, transport.names.rollouts, "rollout")) // GROUP


def _group_versions(transport) -> list[int]:
    """The policy version each group was generated at, in the order they were sent."""
    rollouts = [r.value for r in read_records(transport, transport.names.rollouts, "rollout")]
    return [int(r.token_policy_versions.max()) for r in rollouts if r.sample_index == 0]


@pytest.mark.timeout(120)
def test_a_republished_checkpoint_keeps_the_producers_in_flight_groups_on_the_trained_line(make_config, model_dir):
    cfg = make_config(**{"topics.partitions": {"prompts": 1, "rollouts": 1}})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    wcfg = WeightsConfig(mode="inline", chunk_size=200_000)
    publisher = WeightsPublisher(transport, transport.sink(), wcfg, "trainer-0")
    weights = load_file(str(model_dir / "model.safetensors"))
    send_prompts(transport, [prompt_record(i, group_size=GROUP) for i in range(8)])
    publisher.publish(weights, version=1, step=1)
    # one group per trained version, none ahead: allowed(v) = (trained versions since v1 + 1) groups
    pcfg = ProducerConfig(prompts_per_batch=1, max_new_tokens=4, poll_timeout_s=0.3, weights_startup_wait_s=5.0,
                          max_groups_per_version=1, versions_ahead=0, backpressure_timeout_s=None)
    thread, stop, stats, out = start_producer(cfg, pcfg, HFEngine.from_dir(model_dir), weights_cfg=wcfg)
    try:
        wait_for(lambda: _groups(transport) == 1, "the group of v1", 60, watch=[out])
        for version in (2, 3):  # the trainer trains on: one more group per version
            publisher.publish(weights, version=version, step=version)
            wait_for(lambda v=version: _groups(transport) == v, f"the group of v{version}", 60, watch=[out])
        # killed after checkpoint step 1 (v2, v3 published past it); resumed: step 1's weights as v4
        publisher.publish(weights, version=4, step=1)
        wait_for(lambda: 4 in stats.weight_updates, "the producer to load v4", 30, watch=[out])
        # the resumed trainer trains steps 2, 3, 4 (v5..v7): only past step 3 is there room for a 4th group
        publisher.publish(weights, version=5, step=2)
        publisher.publish(weights, version=6, step=3)
        wait_for(lambda: 6 in stats.weight_updates, "the producer to load v6", 30, watch=[out])
        # v4 is no trained version: 3 groups in flight already exceed the budget (then at v5, v6 too)
        assert _groups(transport) == 3 and _group_versions(transport) == [1, 2, 3]
        publisher.publish(weights, version=7, step=4)
        wait_for(lambda: _groups(transport) == 4, "the group of step 4 (v7)", 60, watch=[out])
    finally:
        final = stop_producer(thread, stop, out)
    assert _group_versions(transport) == [1, 2, 3, 7]  # nothing was generated while holding v4, v5 or v6
    assert final.budget_resets == 0 and final.weight_updates[-1] == 7
