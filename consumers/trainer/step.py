"""One trainer step on one batch: proximal logprobs, advantages, KL, clipped off-policy loss, guarded updates.

Consumes: an engine (:mod:`consumers.trainer.engines`), a :class:`~consumers.trainer.tensors.RolloutBatch`, the
trainer config and the :class:`TrainState` (step, version, KL coefficient, skip counters).
Produces: a flat dict of namespaced metrics (floats); updates the weights through the engine and the state.
Guarantees:
- Every formula comes from ``stream_rl.algorithms``; this module only wires them together.
- Proximal logprobs pi_prox are recomputed with no gradient once, at the start of the batch, with
  ``logits / temperature`` (the sampled distribution); every update of every epoch takes its ratio against them,
  and with ``loss.off_policy_correction`` each token's loss is weighted by pi_prox / mu (mu = behaviour logprobs).
- Exact gradient accumulation: a batch is padded once, and each micro batch's aggregated loss is scaled by its
  share of the minibatch's normaliser (valid tokens for ``token-mean``, non-empty sequences for the two
  ``seq-mean-*`` modes), so the accumulated gradient equals the one of the whole minibatch for every ``agg``.
- NaN/Inf guard: a non-finite micro loss aborts the update before any weight changes (the engine discards the
  gradients); a non-finite gradient norm makes the engine skip the update. Either way the weights and the
  optimizer state are untouched and ``optim/skipped_updates`` counts it.

Rewards: sequence estimators (grpo, dr_grpo, rloo) use the scalar ``reward``; token estimators (reinforce_pp,
gae) use the scorer's ``token_rewards`` when it sent them (the dense form of the whole reward, as the scorer
builds it) and otherwise the scalar ``reward`` on the last response token. With ``kl.placement == "reward"`` the
penalty beta * KL_t is taken from the token rewards (and its sum from the scalar reward).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from consumers.trainer.config import TrainerConfig
from consumers.trainer.tensors import RolloutBatch
from schemas import ScoredRollout
from stream_rl import algorithms as alg

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What the trainer carries between steps besides weights and optimizer (checkpointed as JSON)."""

    step: int = 0
    version: int = 0
    kl_coef: float = 0.0
    skipped_updates: int = 0
    applied_updates: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TrainState:
        return cls(**data)


def lr_at(step: int, cfg: TrainerConfig) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up, then constant, linear or cosine decay to 0."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or cfg.max_steps is None:
        return cfg.lr
    span = max(cfg.max_steps - cfg.warmup_steps, 1)
    progress = min(max((step - cfg.warmup_steps) / span, 0.0), 1.0)
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


# -- forward passes -------------------------------------------------------------------------------------------

def evaluate(engine, batch: RolloutBatch, temperature: float, *,
             entropy: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Logprobs ``[B, T]`` of the response tokens under logits / temperature, optional entropy and values."""
    logits, values = engine.forward(batch)  # [B, T, V], [B, T] | None
    logits = logits.float() / temperature
    logp = alg.logprobs_from_logits(logits, batch.response_ids)  # [B, T]
    ent = alg.entropy_from_logits(logits.detach()) if entropy else None  # [B, T]
    return logp, ent, values


@torch.no_grad()
def proximal_pass(engine, batch: RolloutBatch, cfg: TrainerConfig) -> tuple[Tensor, Tensor, Tensor | None]:
    """pi_prox logprobs, entropy and values (``[B, T]`` each) of the current weights, micro batch by micro batch."""
    parts = [evaluate(engine, batch.select(idx), cfg.temperature, entropy=True)
             for idx in torch.arange(batch.size).split(cfg.micro_batch_size)]
    zero = torch.zeros((), dtype=torch.float32)
    mask = batch.response_mask
    logp = torch.where(mask, torch.cat([p[0] for p in parts]), zero)
    ent = torch.where(mask, torch.cat([p[1] for p in parts]), zero)
    values = None if parts[0][2] is None else torch.where(mask, torch.cat([p[2] for p in parts]), zero)
    return logp, ent, values


# -- advantages -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdvantageInputs:
    rewards: Tensor  # [B] sequence rewards (KL-in-reward already subtracted)
    token_rewards: Tensor  # [B, T] (reward on the last token, KL-in-reward already subtracted)
    mask: Tensor  # [B, T] bool
    group_ids: Tensor  # [B]
    values: Tensor | None  # [B, T] proximal values (gae only)
    gamma: float
    lam: float


def _grpo(x: AdvantageInputs) -> tuple[Tensor, None]:
    return alg.sequence_to_tokens(alg.grpo_advantages(x.rewards, x.group_ids, scale_by_std=True), x.mask), None


def _dr_grpo(x: AdvantageInputs) -> tuple[Tensor, None]:
    return alg.sequence_to_tokens(alg.grpo_advantages(x.rewards, x.group_ids, scale_by_std=False), x.mask), None


def _rloo(x: AdvantageInputs) -> tuple[Tensor, None]:
    return alg.sequence_to_tokens(alg.rloo_advantages(x.rewards, x.group_ids), x.mask), None


def _reinforce_pp(x: AdvantageInputs) -> tuple[Tensor, None]:
    return alg.reinforce_pp_advantages(x.token_rewards, x.mask, x.gamma), None


def _gae(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    return alg.gae(x.token_rewards, x.values, x.mask, x.gamma, x.lam)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs], tuple[Tensor, Tensor | None]]] = {
    "grpo": _grpo, "dr_grpo": _dr_grpo, "rloo": _rloo, "reinforce_pp": _reinforce_pp, "gae": _gae,
}


def advantage_inputs(batch: RolloutBatch, kl_t: Tensor, kl_coef: float, cfg: TrainerConfig,
                     values: Tensor | None) -> AdvantageInputs:
    """Rewards for the estimators, with beta * KL_t subtracted when the KL goes into the reward."""
    mask = batch.response_mask
    penalty = kl_coef * kl_t if cfg.kl.placement == "reward" else torch.zeros_like(kl_t)  # [B, T]
    last = (mask.sum(-1) - 1).clamp_min(0)  # [B] index of the last response token
    terminal = torch.zeros_like(batch.token_rewards)  # [B, T]
    terminal[torch.arange(batch.size), last] = batch.rewards
    token_rewards = torch.where(batch.has_token_rewards[:, None], batch.token_rewards, terminal)  # [B, T]
    token_rewards = torch.where(mask, token_rewards - penalty, torch.zeros(()))  # [B, T]
    rewards = batch.rewards - alg.masked_sum(penalty, mask, dim=-1)  # [B]
    return AdvantageInputs(rewards, token_rewards, mask, batch.group_ids, values, cfg.gamma, cfg.lam)


# -- one update -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchTargets:
    """Per-batch constants of every update: ``[B, T]`` each (returns/old_values only for gae)."""

    old_logp: Tensor
    advantages: Tensor
    returns: Tensor | None
    old_values: Tensor | None


def agg_normaliser(mask: Tensor, agg: str) -> int:
    """What ``agg`` divides by over ``mask`` ``[b, T]``: valid tokens, or sequences with a valid token."""
    return int(mask.sum()) if agg == "token-mean" else int(mask.any(-1).sum())


def micro_loss(engine, sub: RolloutBatch, tg: BatchTargets, idx: Tensor, cfg: TrainerConfig,
               kl_coef: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of one micro batch (policy + KL-in-loss + value), aggregated over that micro batch."""
    logp, _, values = evaluate(engine, sub, cfg.temperature)
    mask, lc = sub.response_mask, cfg.loss
    loss, metrics = alg.policy_loss(
        logp, tg.old_logp[idx], tg.advantages[idx], mask, kind=lc.kind, clip_low=lc.clip_low,
        clip_high=lc.clip_high, dual_clip=lc.dual_clip,
        behavior_logp=sub.behavior_logprobs if lc.off_policy_correction else None,
        is_cap=lc.is_cap if lc.off_policy_correction else None, is_mode=lc.is_mode, agg=lc.agg)
    metrics = {f"policy/{k}": v for k, v in metrics.items()}
    metrics["loss/policy"] = loss.detach()
    if cfg.kl.placement == "loss" and kl_coef > 0:
        kl_loss = alg.aggregate(alg.kl_penalty(logp, sub.ref_logprobs, cfg.kl.kind, mask=mask), mask, lc.agg)
        loss = loss + kl_coef * kl_loss
        metrics["loss/kl"] = kl_loss.detach()
    if tg.returns is not None:
        v_loss, v_metrics = alg.value_loss(values, tg.old_values[idx], tg.returns[idx], mask,
                                           clip=cfg.value_clip, agg=lc.agg)
        loss = loss + cfg.vf_coef * v_loss
        metrics.update({f"value/{k}": v for k, v in v_metrics.items()})
        metrics["loss/value"] = v_loss.detach()
    return loss, metrics


def _merge(acc: dict[str, float], metrics: dict[str, Tensor], weight: float) -> None:
    for key, value in metrics.items():
        v = float(value)
        if key.endswith("_max"):
            acc[key] = max(acc.get(key, -math.inf), v)
        elif key.endswith("_min"):
            acc[key] = min(acc.get(key, math.inf), v)
        else:
            acc[key] = acc.get(key, 0.0) + weight * v


def update(engine, batch: RolloutBatch, tg: BatchTargets, rows: Tensor, cfg: TrainerConfig, kl_coef: float,
           lr: float) -> tuple[bool, float, dict[str, float]]:
    """One optimizer update on the minibatch ``rows``; returns (applied, grad norm, weighted metrics); after a
    non-finite loss: (False, nan, {"loss/total": that loss})."""
    total = max(agg_normaliser(batch.response_mask[rows], cfg.loss.agg), 1)
    micros = rows.split(cfg.micro_batch_size)
    acc: dict[str, float] = {}
    for i, idx in enumerate(micros):
        sub = batch.select(idx)
        weight = agg_normaliser(sub.response_mask, cfg.loss.agg) / total
        loss, metrics = micro_loss(engine, sub, tg, idx, cfg, kl_coef)
        scaled = loss * weight
        if not bool(torch.isfinite(scaled)):
            log.warning("non-finite loss %s in micro batch %d: update skipped, gradients discarded",
                        float(loss.detach()), i)
            engine.discard(scaled)
            return False, math.nan, {"loss/total": float(loss.detach())}  # reported: alerts watch loss/total
        engine.backward(scaled, last_micro=i == len(micros) - 1)
        _merge(acc, {**metrics, "loss/total": loss.detach()}, weight)
    outcome = engine.step(lr)
    if not outcome.applied:
        log.warning("non-finite gradient norm %s: update skipped, gradients discarded", outcome.grad_norm)
    return outcome.applied, outcome.grad_norm, acc


# -- the step ---------------------------------------------------------------------------------------------------

def kl_to_reference(batch: RolloutBatch, logp: Tensor, cfg: TrainerConfig, kl_coef: float) -> Tensor:
    """Per-token KL estimate ``[B, T]`` of pi_prox vs the reference (0 where no reference logprobs came)."""
    if kl_coef > 0 and not bool(batch.has_ref.all()):
        missing = int((~batch.has_ref).sum())
        raise ValueError(f"trainer.kl.coef > 0 but {missing} of {batch.size} rollouts carry no ref_logprobs: "
                         f"give the scorer a reference model or set trainer.kl.coef = 0")
    mask = batch.response_mask & batch.has_ref[:, None]
    return alg.kl_penalty(logp, batch.ref_logprobs, cfg.kl.kind, mask=mask)  # [B, T]


def train_step(engine, batch: RolloutBatch, cfg: TrainerConfig, state: TrainState) -> dict[str, float]:
    """Train on one batch (``epochs`` x ``minibatches`` guarded updates); returns the step's metrics."""
    t0 = time.perf_counter()
    mask = batch.response_mask
    old_logp, entropy, old_values = proximal_pass(engine, batch, cfg)
    kl_t = kl_to_reference(batch, old_logp, cfg, state.kl_coef)
    advantages, returns = ADVANTAGE_ESTIMATORS[cfg.advantage](
        advantage_inputs(batch, kl_t, state.kl_coef, cfg, old_values))
    tg = BatchTargets(old_logp, advantages, returns, old_values)
    t1 = time.perf_counter()
    lr = lr_at(state.step, cfg)
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state.step)
    acc: dict[str, float] = {}
    norms, applied_n, skipped_n, nonfinite_loss = [], 0, 0, None
    for _ in range(cfg.epochs):
        order = torch.randperm(batch.size, generator=generator)
        for rows in order.tensor_split(min(cfg.minibatches, batch.size)):
            applied, norm, metrics = update(engine, batch, tg, rows, cfg, state.kl_coef, lr)
            applied_n, skipped_n = applied_n + applied, skipped_n + (not applied)
            if applied:
                norms.append(norm)
                _merge(acc, metrics, 1.0)
            elif not math.isfinite(metrics.get("loss/total", 0.0)):
                nonfinite_loss = metrics["loss/total"]
    t2 = time.perf_counter()
    state.applied_updates += applied_n
    state.skipped_updates += skipped_n
    out = {k: v / max(applied_n, 1) if not k.endswith(("_max", "_min")) else v for k, v in acc.items()}
    if nonfinite_loss is not None:  # a skipped non-finite loss makes the step's loss non-finite (alert loss_nonfinite)
        out["loss/total"] = nonfinite_loss
    out.update(_batch_metrics(batch, mask, old_logp, entropy, kl_t, advantages))
    kl_mean = out["kl/ref_mean"]
    out["kl/coef"] = state.kl_coef
    if cfg.kl.adaptive and math.isfinite(kl_mean) and bool(batch.has_ref.any()):
        state.kl_coef = alg.adaptive_kl_coef(state.kl_coef, kl_mean, batch.size, cfg.kl.target, cfg.kl.horizon)
    out.update({
        "optim/lr": lr, "optim/grad_norm": sum(norms) / len(norms) if norms else math.nan,
        "optim/updates": float(applied_n), "optim/skipped_updates": float(skipped_n),
        "optim/skipped_updates_total": float(state.skipped_updates),
        "time/proximal_s": t1 - t0, "time/update_s": t2 - t1, "time/train_s": t2 - t0,
        "mismatch/temperature_frac": float((batch.temperatures != cfg.temperature).float().mean()),
        "throughput/train_tokens_per_s": batch.n_tokens * (1 + cfg.epochs) / max(t2 - t0, 1e-9),
    })
    state.step += 1
    return out


def _batch_metrics(batch: RolloutBatch, mask: Tensor, old_logp: Tensor, entropy: Tensor, kl_t: Tensor,
                   advantages: Tensor) -> dict[str, float]:
    """Tensor-side diagnostics: advantages, entropy, KL to the reference, sampler-vs-trainer mismatch."""
    valid = advantages[mask]
    beh = batch.behavior_logprobs
    ref_mask = mask & batch.has_ref[:, None]
    return {
        "advantage/mean": float(valid.mean()) if valid.numel() else 0.0,
        "advantage/std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "advantage/min": float(valid.min()) if valid.numel() else 0.0,
        "advantage/max": float(valid.max()) if valid.numel() else 0.0,
        "policy/entropy": float(alg.masked_mean(entropy, mask)),
        "kl/ref_mean": float(alg.masked_mean(kl_t, ref_mask)) if bool(ref_mask.any()) else math.nan,
        "mismatch/logp_abs_diff": float(alg.masked_mean((beh - old_logp).abs(), mask)),
        "mismatch/kl_mu_prox": float(alg.masked_mean(alg.kl_penalty(beh, old_logp, "k3", mask=mask), mask)),
        "batch/sequences": float(batch.size), "batch/tokens": float(batch.n_tokens),
    }


def rollout_metrics(scored: Sequence[ScoredRollout], current_version: int,
                    success_threshold: float) -> dict[str, float]:
    """Metrics read off the records: rewards, group success, lengths, staleness, generate/score stage timings."""
    rewards = torch.tensor([s.reward for s in scored], dtype=torch.float64)
    groups: dict[str, list[float]] = {}
    for s in scored:
        groups.setdefault(s.group_id, []).append(s.reward)
    success = [sum(r >= success_threshold for r in g) / len(g) for g in groups.values()]
    lengths = [s.rollout.response_length for s in scored]
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
    }
    names = sorted({k for s in scored for k in s.reward_components})
    for name in names:
        values = [s.reward_components[name] for s in scored if name in s.reward_components]
        out[f"reward/{name}"] = sum(values) / len(values)
    out.update(_generate_metrics(scored))
    out.update(_stage_metrics("score", score_s, lengths))
    return out


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
