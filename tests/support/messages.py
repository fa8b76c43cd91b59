"""Small valid messages of every kind, for tests that need realistic records (not a test module)."""

from __future__ import annotations

import hashlib

import numpy as np

from schemas import (
    DeadLetter,
    Prompt,
    Rollout,
    ScoredRollout,
    StaleRollout,
    TensorEntry,
    WeightsChunk,
    WeightsManifest,
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
