"""The wire bytes of every message kind are pinned: today's encoder writes exactly the recorded bytes.

``tests/unit/fixtures/wire_golden.json`` holds, per named instance below, the hex of ``encode(instance)`` as
written by the encoder when the fixture was made (``python tests/unit/fixtures/make_wire_golden.py``; rerun it
only for a deliberate, documented wire change). Every kind is covered, with the optional and added fields both
set and nil, so a refactor of how fields are declared cannot change a byte unnoticed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from schemas import (
    MESSAGE_TYPES, Alert, DeadLetter, Evaluation, GatewayCall, GatewayEpisode, Heartbeat, MemberRejected, PartialGroup,
    Prompt, Rollout, ScoredRollout,
    StaleRollout, TensorEntry, WeightsChunk, WeightsManifest, decode, encode, group_id_for, rollout_id_for,
    to_jsonable,
)

GOLDEN = Path(__file__).parent / "fixtures" / "wire_golden.json"
T0 = 1_700_000_000.25  # created_at of every instance: exact in float64


def _rollout(**changes) -> Rollout:
    fields = dict(
        rollout_id=rollout_id_for("p0", 1, 2), prompt_id="p0", epoch=1, group_id=group_id_for("p0", 1),
        sample_index=2, group_size=4, prompt_token_ids=np.array([7, 8, 9], np.int32),
        response_token_ids=np.array([1, 256, 65536, 3], np.int32),
        behavior_logprobs=np.array([-0.25, -1.5, 0.0, -3.0], np.float32),
        token_policy_versions=np.array([6, 5, 6, 6], np.int64), finish_reason="stop", producer_id="producer-0",
        prompt_text="2+2=", response_text="4</s>", answer="4", metadata={"task": "add"}, attempt=1,
        temperature=0.7, timings={"generate_s": 0.5, "created_at": T0})
    return Rollout(**{**fields, **changes})


def _manifests() -> dict[str, WeightsManifest]:
    payload = np.arange(6, dtype="<f4").tobytes() + np.array([1, -2], "<i8").tobytes()
    tensors = [TensorEntry(name="embed.weight", dtype="F32", shape=(2, 3), offset=0, nbytes=24),
               TensorEntry(name="step", dtype="I64", shape=[2], offset=24, nbytes=16)]
    digest = hashlib.sha256(payload).hexdigest()
    inline = WeightsManifest(version=3, step=30, mode="inline", tensors=tensors, total_bytes=40, sha256=digest,
                             chunk_size=16, chunk_count=3, chunks_topic="stream-rl.run1.weights.v3",
                             created_at=T0, trainer_id="trainer-0")
    delta = dataclasses.replace(inline, version=4, mode="store", chunks_topic=None, chunk_count=1,
                                store_uri="file:///tmp/store/v4.delta", delta_base=2, delta_base_sha256="a" * 64,
                                delta_bytes=11, delta_sha256="b" * 64)
    adapter = dataclasses.replace(inline, version=5, adapter_rank=8, adapter_alpha=16.0)
    return {"weights_manifest/inline": inline, "weights_manifest/store_delta": delta,
            "weights_manifest/adapter": adapter}


def golden_messages() -> dict[str, object]:
    """One or more named instances of every kind; optional and added fields both set and left at their default."""
    multi_turn = _rollout(policy_mask=np.array([1, 0, 0, 1], np.uint8),
                          behavior_logprobs=np.array([-0.25, 0.0, 0.0, -3.0], np.float32),
                          turns=[{"role": "policy"}, {"role": "env", "tool": "calc"}, {"role": "policy"}])
    raw = b"\xc1garbage value"
    return {
        "prompt/full": Prompt(prompt_id="gsm8k/train-17", epoch=2, text="2+2=", answer="4", metadata={"task": "add"},
                              group_size=4, attempt=1, prompt_token_ids=np.array([5, 6, 7], np.int32), created_at=T0,
                              messages=[{"role": "user", "content": "2+2?"}]),
        "prompt/minimal": Prompt(prompt_id="p1", epoch=0, text="hi", group_size=1, created_at=T0),
        "rollout/single_turn": _rollout(),
        "rollout/multi_turn": multi_turn,
        "scored_rollout/full": ScoredRollout(
            rollout=_rollout(), reward=1.25, reward_components={"correct": 1.0, "format": 0.25},
            token_rewards=np.array([0, 0, 0, 1.25], np.float32),
            ref_logprobs=np.array([-0.5, -1.0, -0.125, -2.0], np.float32), scorer_id="scorer-1",
            timings={"score_s": 0.01}),
        "scored_rollout/minimal": ScoredRollout(rollout=multi_turn, reward=-1.0, scorer_id="scorer-1"),
        "member_rejected/decoded": MemberRejected(
            group_id="p0:1", rollout_id="p0:1:2", attempt=1, reason="token id 99", error_type="ValueError",
            source_topic="stream-rl.run1.rollouts", source_partition=2, source_offset=41, consumer_id="scorer-1",
            created_at=T0),
        "member_rejected/undecoded": MemberRejected(
            group_id="p0:1", reason="not msgpack", error_type="SchemaError", source_topic="stream-rl.run1.rollouts",
            source_partition=0, source_offset=0, consumer_id="scorer-1", created_at=T0),
        **_manifests(),
        "weights_chunk/one": WeightsChunk.from_data(version=3, index=1, count=3, data=b"\x00\x01\xff" * 5),
        "dead_letter/truncated": DeadLetter.of_value(
            raw, 4, reason="invalid message: not valid msgpack", error_type="SchemaError",
            source_topic="stream-rl.run1.rollouts", source_partition=2, source_offset=41, raw_key=b"p0:1",
            consumer_id="scorer-1", created_at=T0),
        "dead_letter/tombstone": DeadLetter(
            reason="null value", error_type="SchemaError", source_topic="stream-rl.run1.rollouts", source_partition=0,
            source_offset=7, raw_value=None, consumer_id="scorer-1", created_at=T0),
        "stale_rollout/one": StaleRollout(
            rollout_id="p0:1:3", prompt_id="p0", epoch=1, group_id="p0:1", reason="lag 3 > max_lag 2", lag=3,
            max_lag=2, trainer_version=9, requeued=True, created_at=T0),
        "heartbeat/one": Heartbeat(
            role="trainer", instance_id="trainer-1a2b3c4d", host="node-1", pid=4242, state="ready", policy_version=-1,
            step=14, rates={"records_in": 12.5}, metrics={"loss/policy": -0.03}, open_alerts=["consumer_lag"],
            interval_s=5.0, created_at=T0),
        "alert/with_value": Alert(
            name="consumer_lag", state="firing", action="pause", role="producer", instance_id="producer-0",
            message="lag 120 > 100", value=120.0, threshold=100.0, created_at=T0),
        "alert/without_value": Alert(
            name="loss_nonfinite", state="resolved", action="stop", role="trainer", instance_id="trainer-0",
            message="loss/total is nan", created_at=T0),
        "gateway_call/one": GatewayCall(
            episode_id="calc-7/0", call_index=1, endpoint="chat", messages_json='[{"role": "user", "content": "2+3?"}]',
            tools_json='[{"type": "function"}]', prompt_token_ids=np.array([7, 8, 9], np.int32),
            response_token_ids=np.array([1, 2], np.int32), behavior_logprobs=np.array([-0.25, -1.5], np.float32),
            token_policy_versions=np.array([6, 6], np.int64), finish_reason="stop", temperature=0.7,
            response_text="5", created_at=T0),
        "gateway_episode/ended": GatewayEpisode(
            episode_id="calc-7/0", outcome="ended", reward=0.5, answer="5", metadata={"task": "calc"}, reason="",
            calls=2, created_at=T0),
        "gateway_episode/dead": GatewayEpisode(
            episode_id="calc-7/1", outcome="dead_lettered", reason="timeout", calls=1, created_at=T0),
        "gateway_episode/refilled": GatewayEpisode(
            episode_id="calc-7/2", outcome="dead_lettered", reason="the tool crashed", calls=0, created_at=T0,
            refill=True),
        "partial_group/one": PartialGroup(
            group_id="p1:0", prompt=Prompt(prompt_id="p1", epoch=0, text="hi", group_size=2, created_at=T0),
            prompt_token_ids=np.array([7, 8], np.int32), sample_lengths=np.array([2, 3], np.int32),
            token_ids=np.array([1, 2, 256, 65536, 3], np.int32),
            behavior_logprobs=np.array([-0.25, 0.0, -1.5, -3.0, -0.5], np.float32),
            token_policy_versions=np.array([5, 5, 5, 6, 6], np.int64), finish_reasons=["stop", "cut"], cuts=1,
            producer_id="producer-0", created_at=T0),
        "evaluation/one": Evaluation(
            version=3, step=30, sets=["heldout", "gsm8k"], metrics={"heldout/pass@8": 0.75}, evaluator_id="eval-1",
            elapsed_s=1.5, created_at=T0),
    }


def _golden() -> dict[str, str]:
    return json.loads(GOLDEN.read_text())


def test_the_fixture_covers_every_kind_and_every_instance():
    names = set(golden_messages())
    assert set(_golden()) == names
    assert {name.split("/")[0] for name in names} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("name", sorted(golden_messages()))
def test_encode_writes_the_recorded_bytes_and_they_decode_back_equal(name):
    msg = golden_messages()[name]
    recorded = bytes.fromhex(_golden()[name])
    assert encode(msg) == recorded
    back = decode(recorded)
    assert type(back) is type(msg) and back == msg
    assert to_jsonable(back) == to_jsonable(msg)
    assert encode(back) == recorded
