"""The tests' message factories, one module: small valid messages of every kind.

- ``prompt(i)``, ``rollout(i, sample)``, ``scored(i, sample)``, ``weights()``, ``dead_letter()``, ``stale()``,
  ``every_kind()``: records indexed by prompt and sample, for transport and CLI tests.
- ``make_<kind>()`` and :data:`MAKERS` (one per wire kind), ``rewrite``, ``DROP``: fixed instances and byte-level
  edits for the schema and wire-format tests.
- ``rollout_for_scoring(i, sample, prompt_ids=..., response_ids=...)``: a rollout whose tokens a tiny reference
  model scores (the scorer's tests).

The trainer's scored rollouts with exact logprobs of a tiny policy are :func:`support.trainer.scored`.
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np

from schemas import (
    PartialGroup,
    Alert,
    DeadLetter,
    Evaluation,
    Heartbeat,
    MemberRejected,
    Prompt,
    Rollout,
    ScoredRollout,
    StaleRollout,
    TensorEntry,
    WeightsChunk,
    WeightsManifest,
    chunk_count_for,
    group_id_for,
    rollout_id_for,
)


def prompt(i: int = 0, epoch: int = 0) -> Prompt:
    return Prompt(prompt_id=f"p{i}", epoch=epoch, text=f"{i}+1=", answer=str(i + 1), group_size=4)


def rollout(i: int = 0, sample: int = 0, epoch: int = 0, version: int = 3, n_tokens: int = 5) -> Rollout:
    rng = np.random.default_rng(i * 100 + sample)
    return Rollout(
        rollout_id=rollout_id_for(f"p{i}", epoch, sample), prompt_id=f"p{i}", epoch=epoch,
        group_id=group_id_for(f"p{i}", epoch), sample_index=sample, group_size=4,
        prompt_token_ids=np.arange(4, dtype=np.int32),
        response_token_ids=rng.integers(0, 16, n_tokens).astype(np.int32),
        behavior_logprobs=-rng.random(n_tokens).astype(np.float32),
        token_policy_versions=np.full(n_tokens, version, dtype=np.int64),
        finish_reason="stop", producer_id="producer-0", prompt_text=f"{i}+1=", response_text="SECRET-RESPONSE",
        answer=str(i + 1), temperature=1.0, timings={"generate_s": 0.01})


def scored(i: int = 0, sample: int = 0) -> ScoredRollout:
    r = rollout(i, sample)
    n = len(r.response_token_ids)
    return ScoredRollout(rollout=r, reward=1.0, reward_components={"verifier": 1.0},
                         token_rewards=np.zeros(n, dtype=np.float32),
                         ref_logprobs=np.full(n, -0.5, dtype=np.float32), scorer_id="scorer-0")


def weights(version: int = 1) -> tuple[WeightsManifest, WeightsChunk]:
    data = np.arange(6, dtype=np.float32).tobytes()
    digest = hashlib.sha256(data).hexdigest()
    manifest = WeightsManifest(
        version=version, step=10, mode="inline", tensors=[TensorEntry(name="w", dtype="F32", shape=(2, 3), offset=0, nbytes=len(data))],
        total_bytes=len(data), sha256=digest, chunk_size=1024, chunk_count=1, chunks_topic="stream-rl.x.weights.v1",
        trainer_id="trainer-0")
    return manifest, WeightsChunk(version=version, index=0, count=1, data=data, sha256=digest)


def dead_letter() -> DeadLetter:
    return DeadLetter(reason="bad", error_type="SchemaError", source_topic="t", source_partition=0, source_offset=3,
                      raw_value=b"\x00\x01", raw_key=b"k", consumer_id="c")


def stale() -> StaleRollout:
    return StaleRollout(rollout_id=rollout_id_for("p0", 0, 0), prompt_id="p0", epoch=0,
                        group_id=group_id_for("p0", 0), reason="lag 3 > max_lag 1", lag=3, max_lag=1,
                        trainer_version=5, requeued=True)


def every_kind() -> list:
    manifest, chunk = weights()
    return [prompt(), rollout(), scored(), manifest, chunk, dead_letter(), stale()]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_prompt() -> Prompt:
    return Prompt(prompt_id="gsm8k/train-17", epoch=2, text="2+2=", answer="4", metadata={"task": "add"},
                  group_size=4, attempt=1, prompt_token_ids=np.array([5, 6, 7], np.int32), created_at=1.7e9)


def make_rollout(**changes) -> Rollout:
    fields = dict(
        rollout_id=rollout_id_for("p0", 1, 2), prompt_id="p0", epoch=1, group_id=group_id_for("p0", 1),
        sample_index=2, group_size=4, prompt_token_ids=np.array([7, 8, 9], np.int32),
        response_token_ids=np.array([1, 256, 65536, 3], np.int32),
        behavior_logprobs=np.array([-0.25, -1.5, 0.0, -3.0], np.float32),
        token_policy_versions=np.array([6, 5, 6, 6], np.int64), finish_reason="stop", producer_id="producer-0",
        prompt_text="2+2=", response_text="4</s>", answer="4", metadata={"task": "add"}, attempt=0,
        temperature=0.7, timings={"generate_s": 0.5, "created_at": 1.7e9})
    return Rollout(**{**fields, **changes})


def make_scored() -> ScoredRollout:
    return ScoredRollout(rollout=make_rollout(), reward=1.25, reward_components={"correct": 1.0, "format": 0.25},
                         token_rewards=np.array([0, 0, 0, 1.25], np.float32),
                         ref_logprobs=np.array([-0.5, -1.0, -0.125, -2.0], np.float32), scorer_id="scorer-1",
                         timings={"score_s": 0.01})


ARRAYS = {"embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
          "head.bias": np.array([1, -2, 3], np.float16), "step": np.array([7], np.int64)}


SAFETENSORS_NAME = {"float32": "F32", "float16": "F16", "int64": "I64"}


def make_manifest(mode: str = "inline", chunk_size: int = 40) -> tuple[bytes, WeightsManifest]:
    entries, offset = [], 0
    for name, array in ARRAYS.items():
        entries.append(TensorEntry(name=name, dtype=SAFETENSORS_NAME[array.dtype.name], shape=list(array.shape),
                                   offset=offset, nbytes=array.nbytes))
        offset += array.nbytes
    payload = b"".join(a.astype(a.dtype.newbyteorder("<")).tobytes() for a in ARRAYS.values())
    inline = mode == "inline"
    return payload, WeightsManifest(
        version=3, step=30, mode=mode, tensors=entries, total_bytes=len(payload), sha256=sha(payload),
        chunk_size=chunk_size, chunk_count=chunk_count_for(len(payload), chunk_size),
        chunks_topic="stream-rl.run1.weights.v3" if inline else None,
        store_uri=None if inline else "file:///tmp/store/v3.safetensors", created_at=1.7e9, trainer_id="trainer-0")


def make_chunk() -> WeightsChunk:
    return WeightsChunk.from_data(version=3, index=1, count=2, data=b"\x00\x01\xff" * 5)


def make_dead_letter() -> DeadLetter:
    return DeadLetter(reason="invalid message: not valid msgpack", error_type="SchemaError",
                      source_topic="stream-rl.run1.rollouts", source_partition=2, source_offset=41,
                      raw_value=b"\xc1garbage", raw_key=b"p0:1", consumer_id="scorer-1", created_at=1.7e9)


def make_stale() -> StaleRollout:
    return StaleRollout(rollout_id=rollout_id_for("p0", 1, 3), prompt_id="p0", epoch=1,
                        group_id=group_id_for("p0", 1), reason="lag 3 > max_lag 2", lag=3, max_lag=2,
                        trainer_version=9, requeued=True, created_at=1.7e9)


def make_member_rejected() -> MemberRejected:
    return MemberRejected(group_id=group_id_for("p0", 1), rollout_id=rollout_id_for("p0", 1, 2), attempt=1,
                          reason="reference model cannot score this rollout: token id 99", error_type="ValueError",
                          source_topic="stream-rl.run1.rollouts", source_partition=2, source_offset=41,
                          consumer_id="scorer-1", created_at=1.7e9)


def make_heartbeat() -> Heartbeat:
    return Heartbeat(role="trainer", instance_id="trainer-1a2b3c4d", host="node-1", pid=4242, state="ready",
                     policy_version=7, step=14, rates={"records_in": 12.5, "tokens": 880.0},
                     metrics={"loss/policy": -0.03, "lag/total": 3.0}, open_alerts=["consumer_lag"],
                     interval_s=5.0, created_at=1.7e9)


def make_alert() -> Alert:
    return Alert(name="loss_nonfinite", state="firing", action="stop", role="trainer",
                 instance_id="trainer-1a2b3c4d", message="loss/total is nan", value=None, threshold=None,
                 created_at=1.7e9)


def make_evaluation() -> Evaluation:
    return Evaluation(version=3, step=30, sets=["heldout"], metrics={"heldout/pass@8": 0.75, "heldout/mean@8": 0.5},
                      evaluator_id="evaluator-1a2b3c4d", elapsed_s=1.5, created_at=1.7e9)


def make_gateway_call(**changes):
    """A recorded gateway call (tests/unit/test_gateway_episodes.py builds chains of them)."""
    from schemas import GatewayCall

    fields = dict(episode_id="calc-7/0", call_index=1, endpoint="chat",
                  messages_json='[{"role": "user", "content": "2+3?"}]', tools_json="[]",
                  prompt_token_ids=np.array([7, 8, 9], np.int32), response_token_ids=np.array([1, 2], np.int32),
                  behavior_logprobs=np.array([-0.25, -1.5], np.float32),
                  token_policy_versions=np.array([6, 6], np.int64), finish_reason="stop", temperature=0.7,
                  response_text="5", created_at=1_700_000_000.25)
    return GatewayCall(**{**fields, **changes})


def make_gateway_episode(**changes):
    from schemas import GatewayEpisode

    fields = dict(episode_id="calc-7/0", outcome="ended", reward=0.5, answer="5", metadata={"task": "calc"},
                  reason="", calls=2, created_at=1_700_000_000.25)
    return GatewayEpisode(**{**fields, **changes})


def make_partial_group(**changes) -> PartialGroup:
    """Sample 0 ended at its stop after 2 tokens (v5, v5); sample 1 was cut after 3 (v5, v5, v6)."""
    fields = dict(group_id="gsm8k/train-17:2", prompt=dataclasses.replace(make_prompt(), group_size=2),
                  prompt_token_ids=np.array([5, 6, 7], np.int32), sample_lengths=np.array([2, 3], np.int32),
                  token_ids=np.array([9, 2, 11, 12, 13], np.int32),
                  behavior_logprobs=np.array([-0.5, -0.25, -1.0, -2.0, 0.0], np.float32),
                  token_policy_versions=np.array([5, 5, 5, 5, 6], np.int64), finish_reasons=["stop", "cut"], cuts=1,
                  producer_id="producer-1", created_at=1.7e9)
    fields.update(changes)
    return PartialGroup(**fields)


MAKERS = {"prompt": make_prompt, "rollout": make_rollout, "scored_rollout": make_scored,
          "weights_manifest": lambda: make_manifest()[1], "weights_chunk": make_chunk,
          "dead_letter": make_dead_letter, "stale_rollout": make_stale, "heartbeat": make_heartbeat,
          "alert": make_alert, "member_rejected": make_member_rejected,
          "evaluation": make_evaluation, "gateway_call": make_gateway_call,
          "gateway_episode": make_gateway_episode, "partial_group": make_partial_group}


def rewrite(record: bytes, **changes) -> bytes:
    """``record`` with top-level fields replaced (``DROP`` removes one), written without validation."""
    raw = msgpack.unpackb(record, raw=False)
    raw.update(changes)
    return msgpack.packb({k: v for k, v in raw.items() if v is not DROP}, use_bin_type=True)


DROP = object()


def rollout_for_scoring(i: int, sample: int = 0, *, prompt_ids=(1, 5, 6), response_ids=(7, 8, 2), temperature=1.0,
                 response_text="7", answer="7", metadata=None, prompt_text="3+4=") -> Rollout:
    n = len(response_ids)
    return Rollout(
        rollout_id=rollout_id_for(f"q{i}", 0, sample), prompt_id=f"q{i}", epoch=0, group_id=group_id_for(f"q{i}", 0),
        sample_index=sample, group_size=4, prompt_token_ids=np.array(prompt_ids, dtype=np.int32),
        response_token_ids=np.array(response_ids, dtype=np.int32),
        behavior_logprobs=np.full(n, -0.5, dtype=np.float32), token_policy_versions=np.zeros(n, dtype=np.int64),
        finish_reason="stop", producer_id="producer-0", prompt_text=prompt_text, response_text=response_text,
        answer=answer, metadata=dict(metadata or {}), temperature=temperature)
