"""One trainer step on one batch: proximal logprobs, advantages, KL, clipped off-policy loss, guarded updates.

Consumes: an engine (:mod:`consumers.trainer.engines`), a :class:`~consumers.trainer.tensors.RolloutBatch`, the
trainer config and the :class:`TrainState` (step, version, KL coefficient, skip counters).
Produces: a flat dict of namespaced metrics (floats); updates the weights through the engine and the state.
Guarantees:
- Every formula comes from ``stream_rl.algorithms``; the phases are modules of their own: forward passes
  (:mod:`~consumers.trainer.forward`), targets (:mod:`~consumers.trainer.targets`) and one optimizer update
  (:mod:`~consumers.trainer.update`); this module sequences them.
- Proximal logprobs pi_prox are those of the weights before the batch's first update, under each rollout's own
  temperature; every update of every epoch takes its ratio against them, and with ``loss.off_policy_correction``
  each token's loss is weighted by pi_prox / mu (mu = behaviour logprobs).
- No forward pass for nothing: with ``epochs * minibatches == 1`` the single update's forward computes exactly
  pi_prox (its ratio is identically 1), so the separate no-grad proximal pass runs only when something before the
  update needs it (GAE's values, a KL penalty in the reward) or ``trainer.recompute_proximal = "always"``.
- NaN/Inf guard (in :func:`~consumers.trainer.update.update`): a skipped update leaves weights and optimizer state
  untouched and ``optim/skipped_updates`` counts it; ``optim/updates`` counts the applied ones, and a step with
  none applied trained nothing (the loop then drops its groups instead of marking them trained).
- Sampler/trainer mismatch: ``mismatch/logp_abs_diff`` = mean over response tokens of |mu - pi_prox|, taken only
  over the rollouts sampled entirely by the weights the trainer holds (every token's version == the state's
  version: lag 0), so it measures the sampler/trainer numerics, not staleness; ``mismatch/on_policy_samples``
  counts those rollouts, and with none the mismatch key is left out (not 0). The off-policy gap over every
  rollout, whatever its lag, stays in ``mismatch/kl_mu_prox`` (k3 KL of mu to pi_prox) and
  ``mismatch/offpolicy_logp_abs_diff``.
- Data parallel (``engine.ranks``): each rank runs its share of every pass; pi_prox, the recorded logprobs and the
  metrics are reduced over ranks, so the state and the metrics are the same on every rank and equal (to float
  rounding) what one rank computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from consumers.trainer.config import TrainerConfig
from consumers.trainer.forward import Proximal, proximal_pass
from consumers.trainer.targets import (
    BatchTargets,
    batch_advantages,
    kl_to_reference,
    length_penalty,
    loss_batch,
    require_refs,
)
from consumers.trainer.tensors import RolloutBatch
from consumers.trainer.update import ForwardRecord, merge, update
from stream_rl import algorithms as alg

if TYPE_CHECKING:
    from consumers.trainer.engines import TrainEngine


@dataclass
class TrainState:
    """What the trainer carries between steps besides weights and optimizer (checkpointed as JSON)."""

    step: int = 0
    version: int = 0
    kl_coef: float = 0.0
    skipped_updates: int = 0
    applied_updates: int = 0
    lineage: list[list[int]] = field(default_factory=list)
    """Resume jumps ``[base, republished]`` (consumers.trainer.lineage): staleness is measured along them."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TrainState:
        return cls(**data)


def skip_reason(step: int, metrics: dict[str, float]) -> str:
    """Why step ``step`` applied no update: its non-finite loss, else a non-finite gradient norm."""
    loss = metrics.get("loss/total")
    if loss is not None and not math.isfinite(loss):
        return f"step {step}: update skipped: non-finite loss {loss}"
    return f"step {step}: update skipped: non-finite gradient norm"


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


def _kl_in_reward(cfg: TrainerConfig, kl_coef: float) -> bool:
    """A KL penalty goes into the rewards, so the advantages need pi_prox before the first update."""
    return cfg.kl.placement == "reward" and kl_coef > 0


def needs_proximal_pass(cfg: TrainerConfig, kl_coef: float) -> bool:
    """True unless the single update's own forward can stand in for the proximal pass (module docstring)."""
    if cfg.recompute_proximal == "always" or cfg.epochs * cfg.minibatches > 1:
        return True
    return cfg.advantage == "gae" or _kl_in_reward(cfg, kl_coef)


def _targets(engine: TrainEngine, batch: RolloutBatch, cfg: TrainerConfig,
             kl_coef: float) -> tuple[BatchTargets, Proximal | None]:
    """The batch's targets, and the proximal pass when one ran."""
    require_refs(batch, kl_coef)
    prox = (proximal_pass(engine, batch, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
            if needs_proximal_pass(cfg, kl_coef) else None)
    kl_t = None
    if _kl_in_reward(cfg, kl_coef):
        assert prox is not None and cfg.kl.kind is not None  # the KL in the reward needs the proximal pass; the
        kl_t = kl_to_reference(batch, prox.logp, cfg.kl.kind)  # kind is resolved when the config loads
    values = prox.values if prox is not None else None
    advantages, returns = batch_advantages(batch, cfg, kl_coef, kl_t, values)
    return BatchTargets(prox.logp if prox is not None else None, advantages, returns, values), prox


def _updates(engine: TrainEngine, batch: RolloutBatch, tg: BatchTargets, cfg: TrainerConfig, state: TrainState,
             lr: float, record: ForwardRecord | None) -> tuple[dict[str, float], list[float], int, int, float | None]:
    """``epochs`` x ``minibatches`` guarded updates: (summed metrics, grad norms, applied, skipped, bad loss)."""
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state.step)
    acc: dict[str, float] = {}
    norms, applied_n, skipped_n, nonfinite_loss = [], 0, 0, None
    for _ in range(cfg.epochs):
        order = torch.randperm(batch.size, generator=generator)
        for rows in order.to(batch.device).tensor_split(min(cfg.minibatches, batch.size)):
            applied, norm, metrics = update(engine, batch, tg, rows, cfg, state.kl_coef, lr, record)
            applied_n, skipped_n = applied_n + applied, skipped_n + (not applied)
            if applied:
                norms.append(norm)
                merge(acc, metrics, 1.0)
            elif not math.isfinite(metrics.get("loss/total", 0.0)):
                nonfinite_loss = metrics["loss/total"]
    return acc, norms, applied_n, skipped_n, nonfinite_loss


def train_step(engine: TrainEngine, batch: RolloutBatch, cfg: TrainerConfig, state: TrainState) -> dict[str, float]:
    """Train on one batch (``epochs`` x ``minibatches`` guarded updates); returns the step's metrics.

    On several ranks every rank calls this with the same batch and state and gets the same metrics and state."""
    t0 = time.perf_counter()
    batch = batch.to(engine.device)
    tg, prox = _targets(engine, batch, cfg, state.kl_coef)
    t1 = time.perf_counter()
    lr = lr_at(state.step, cfg)
    record = ForwardRecord.empty(batch) if prox is None else None
    acc, norms, applied_n, skipped_n, nonfinite_loss = _updates(engine, loss_batch(batch, cfg), tg, cfg, state, lr,
                                                                record)
    t2 = time.perf_counter()
    if record is not None:
        record.gather(engine.ranks)
    seen = prox if prox is not None else record  # the proximal pass, else the record of the first update
    assert seen is not None
    prox_logp, entropy = seen.logp, seen.entropy
    state.applied_updates += applied_n
    state.skipped_updates += skipped_n
    out = {k: v / max(applied_n, 1) if not k.endswith(("_max", "_min")) else v for k, v in acc.items()}
    if nonfinite_loss is not None:  # a skipped non-finite loss makes the step's loss non-finite (alert loss_nonfinite)
        out["loss/total"] = nonfinite_loss
    out.update(_batch_metrics(batch, prox_logp, entropy, tg.advantages))
    out.update(on_policy_mismatch(batch.behavior_logp, prox_logp, batch.response_mask, batch.token_versions,
                                  state.version))
    out["kl/coef"] = state.kl_coef
    out["batch/truncated_fraction"] = float(batch.truncated.float().mean())
    if cfg.overlong.buffer is not None:
        out["reward/overlong_penalty_mean"] = float(length_penalty(batch, cfg).mean())
    kl_mean = out["kl/ref_mean"]
    if cfg.kl.adaptive and math.isfinite(kl_mean) and bool(batch.has_ref.any()):
        state.kl_coef = alg.adaptive_kl_coef(state.kl_coef, kl_mean, batch.size, cfg.kl.target, cfg.kl.horizon)
    ran_proximal = tg.prox_logp is not None
    passes = cfg.epochs + ran_proximal  # forward passes over the whole batch
    out.update({
        "optim/lr": lr, "optim/grad_norm": sum(norms) / len(norms) if norms else math.nan,
        "optim/updates": float(applied_n), "optim/skipped_updates": float(skipped_n),
        "optim/skipped_updates_total": float(state.skipped_updates),
        "time/proximal_s": t1 - t0, "time/update_s": t2 - t1, "time/train_s": t2 - t0,
        "batch/proximal_pass": float(ran_proximal),
        "throughput/train_tokens_per_s": batch.n_tokens * passes / max(t2 - t0, 1e-9),
    })
    state.step += 1
    return out


def _batch_metrics(batch: RolloutBatch, prox_logp: Tensor, entropy: Tensor, advantages: Tensor) -> dict[str, float]:
    """Tensor-side diagnostics: advantages, entropy, KL to the reference (k3 of pi_prox), the off-policy gap of
    mu to pi_prox over every rollout (any lag)."""
    mask = batch.response_mask
    valid = advantages[mask]
    beh = batch.behavior_logp
    ref_mask = mask & batch.has_ref[:, None]
    kl_t = alg.kl_penalty(prox_logp, batch.ref_logp, "k3", mask=ref_mask)  # [B, T]
    return {
        "advantage/mean": float(valid.mean()) if valid.numel() else 0.0,
        "advantage/std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "advantage/min": float(valid.min()) if valid.numel() else 0.0,
        "advantage/max": float(valid.max()) if valid.numel() else 0.0,
        "policy/entropy": float(alg.masked_mean(entropy, mask)),
        "kl/ref_mean": float(alg.masked_mean(kl_t, ref_mask)) if bool(ref_mask.any()) else math.nan,
        "mismatch/offpolicy_logp_abs_diff": float(alg.masked_mean((beh - prox_logp).abs(), mask)),
        "mismatch/kl_mu_prox": float(alg.masked_mean(alg.kl_penalty(beh, prox_logp, "k3", mask=mask), mask)),
        "batch/sequences": float(batch.size), "batch/tokens": float(batch.n_tokens),
        "batch/temperature_mean": float(batch.temperatures.mean()),
    }


def on_policy_mismatch(behavior_logp: Tensor, prox_logp: Tensor, mask: Tensor, token_versions: Tensor,
                       version: int) -> dict[str, float]:
    """The sampler/trainer logprob mismatch over the rollouts of lag 0 only::

        on(b)  <=>  b has a response token and every one has version == ``version`` (the trainer's weights)
        mismatch/logp_abs_diff    = sum over tokens of on rows of |mu - pi_prox| / their token count
        mismatch/on_policy_samples = #{b : on(b)}

    ``mismatch/logp_abs_diff`` is absent when no rollout is on policy (a stale batch says nothing about numerics).
    Shapes: all [B, T]; ``mask`` bool, ``token_versions`` int64."""
    same = (token_versions == version) | ~mask  # [B, T]: padding does not disqualify a row
    on = same.all(dim=1) & mask.any(dim=1)  # [B]
    out = {"mismatch/on_policy_samples": float(on.sum())}
    if bool(on.any()):
        rows = mask & on[:, None]  # [B, T]
        out["mismatch/logp_abs_diff"] = float(alg.masked_mean((behavior_logp - prox_logp).abs(), rows))
    return out
