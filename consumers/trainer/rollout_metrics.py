"""Metrics read off the scored records of a step (no tensors, no model): rewards, lengths, staleness, stage times.

Consumes: the ``ScoredRollout`` records of one trainer step and the trainer's current policy version.
Produces: a flat dict of namespaced floats (``reward/*``, ``accuracy/*``, ``response/*``, ``staleness/*``,
``time/*``, ``throughput/*``) that the trainer loop logs with the step's training metrics.
Guarantees: pure; every value is computed from the records themselves (producer and scorer timings included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from schemas import ScoredRollout
from stream_rl.rewards.verifiers import VERIFIERS

SOURCE_KEY = "data_source"
"""The prompt metadata key the per-source metrics group by (whatever key ``scorer.rewards`` routes on)."""


def rollout_metrics(scored: Sequence[ScoredRollout], current_version: int, success_threshold: float,
                    lags: Sequence[int] | None = None, now: float | None = None) -> dict[str, float]:
    """Metrics read off the records: rewards, group success, lengths, staleness, generate/score stage timings.
    ``lags``: each rollout's policy lag as the batcher measured it (through a resume's lineage); default
    ``current_version - min_policy_version``. ``now`` (wall-clock seconds when the step starts training) adds
    ``time/rollout_age_s_mean``: how long after its generation ended a rollout reached training (scoring,
    transport and waiting for its group and for the trainer), over the rollouts that carry ``created_at``."""
    rewards = torch.tensor([s.reward for s in scored], dtype=torch.float64)
    groups: dict[str, list[float]] = {}
    for s in scored:
        groups.setdefault(s.group_id, []).append(s.reward)
    success = [sum(r >= success_threshold for r in g) / len(g) for g in groups.values()]
    lengths = [s.rollout.response_length for s in scored]
    if lags is None:
        lags = [current_version - s.rollout.min_policy_version for s in scored]
    score_s = [s.timings.get("score_s") for s in scored]
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/group_success_rate": sum(success) / len(success),
        "reward/groups_any_success": sum(s > 0 for s in success) / len(success),
        "reward/groups_zero_std": sum(max(g) == min(g) for g in groups.values()) / len(groups),
        "response/length_mean": sum(lengths) / len(lengths),
        "response/length_max": float(max(lengths)),
        "response/truncated_frac": sum(s.rollout.finish_reason == "length" for s in scored) / len(scored),
        "staleness/mean_lag": sum(lags) / len(lags),
        "staleness/max_lag": float(max(lags)),
        **_token_staleness(scored, lags),
    }
    names = sorted({k for s in scored for k in s.reward_components})
    for name in names:
        values = [s.reward_components[name] for s in scored if name in s.reward_components]
        out[f"reward/{name}"] = sum(values) / len(values)
    out.update(source_metrics(scored))
    out.update(_generate_metrics(scored))
    out.update(_stage_metrics("score", score_s, lengths))
    created = [s.rollout.timings["created_at"] for s in scored if "created_at" in s.rollout.timings]
    if now is not None and created:
        out["time/rollout_age_s_mean"] = now - sum(created) / len(created)
    return out


def source_metrics(scored: Sequence[ScoredRollout]) -> dict[str, float]:
    """Reward and accuracy per data source (``rollout.metadata["data_source"]``; rollouts without it are left out)::

        reward/source/<src>   = mean of reward over the source's rollouts
        accuracy/source/<src> = #{b : every built-in verifier component of b is non-zero} / #{b : b has one}

    A built-in verifier (``gsm8k``, ``math_boxed``, ``multiple_choice``) scores 1.0 or 0.0 and its component is
    ``weight * score`` with a non-zero weight, so a non-zero component means a correct answer, whatever the weight
    and whatever other functions (format bonuses) add. Accuracy is reported only for a source whose rollouts carry
    a verifier component (a source scored by user functions or a reward model alone has no accuracy)."""
    rewards: dict[str, list[float]] = {}
    correct: dict[str, list[bool]] = {}
    for s in scored:
        source = s.rollout.metadata.get(SOURCE_KEY)
        if source is None:
            continue
        rewards.setdefault(source, []).append(s.reward)
        verdicts = [value != 0 for name, value in s.reward_components.items() if name in VERIFIERS]
        if verdicts:
            correct.setdefault(source, []).append(all(verdicts))
    out = {f"reward/source/{src}": sum(values) / len(values) for src, values in sorted(rewards.items())}
    out.update({f"accuracy/source/{src}": sum(values) / len(values) for src, values in sorted(correct.items())})
    return out


def _token_staleness(scored: Sequence[ScoredRollout], lags: Sequence[int]) -> dict[str, float]:
    """Staleness per token, for rollouts whose versions change mid-response (in-flight weight updates)::

        token_lag_bt = max(lag_b - (v_bt - min_t v_bt), 0)      (lag_b: the rollout's lag, by its oldest token)
        staleness/token_mean_lag = mean over every response token of token_lag_bt
        staleness/mixed_version_frac = #{b : min_t v_bt < max_t v_bt} / B
    """
    total, count, mixed = 0.0, 0, 0
    for s, lag in zip(scored, lags, strict=True):
        versions = s.rollout.token_policy_versions  # [R] int64
        oldest = int(versions.min())
        total += float((lag - (versions - oldest)).clip(min=0).sum())
        count += len(versions)
        mixed += int(versions.max()) != oldest
    return {"staleness/token_mean_lag": total / max(count, 1), "staleness/mixed_version_frac": mixed / len(lags)}


def _stage_metrics(stage: str, seconds: Sequence[float | None], lengths: Sequence[int]) -> dict[str, float]:
    """Per-rollout shares of a stage's time (the scorer's ``score_s``): mean share and tokens per second."""
    pairs = [(s, n) for s, n in zip(seconds, lengths) if s is not None]
    if not pairs:
        return {}
    total_s = sum(s for s, _ in pairs)
    return {f"time/{stage}_s_mean": total_s / len(pairs),
            f"throughput/{stage}_tokens_per_s": sum(n for _, n in pairs) / total_s if total_s > 0 else math.nan}


def _generate_metrics(scored: Sequence[ScoredRollout]) -> dict[str, float]:
    """Producers stamp their whole generation batch's ``generate_s`` on every rollout of it: count each producer
    batch (producer id, ``created_at``) once. Tokens/s is a lower bound when only part of a batch is here."""
    batches: dict[tuple[str, float], list[int]] = {}
    seconds: dict[tuple[str, float], float] = {}
    for s in scored:
        r = s.rollout
        if "generate_s" not in r.timings:
            continue
        key = (r.producer_id, r.timings.get("created_at", -1.0))
        batches.setdefault(key, []).append(r.response_length)
        seconds[key] = r.timings["generate_s"]
    if not batches:
        return {}
    total_s = sum(seconds.values())
    tokens = sum(sum(lengths) for lengths in batches.values())
    return {"time/generate_s_mean": total_s / len(batches),
            "throughput/generate_tokens_per_s": tokens / total_s if total_s > 0 else math.nan}
