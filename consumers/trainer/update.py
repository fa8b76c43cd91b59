"""One optimizer update on a minibatch: micro-batch losses over one normaliser, accumulated, guarded, applied.

Consumes: an engine, a :class:`~consumers.trainer.tensors.RolloutBatch`, its
:class:`~consumers.trainer.targets.BatchTargets`, the rows of the minibatch, the trainer config, the KL coefficient
and the learning rate.
Produces: ``(applied, grad_norm, metrics)``; the weights change through the engine only when ``applied``.
Guarantees:
- Exact gradient accumulation: the minibatch's loss normaliser (``stream_rl.algorithms.loss_normaliser``: valid
  tokens, non-empty sequences, or sequences times the generation budget) is computed once over all its rows, and
  every micro batch's loss is divided by it, so the micro losses sum to the minibatch's loss for every ``agg`` and
  their gradients to its gradient. Every rank holds the whole batch, so this one number is the global count, and
  data-parallel ranks, each back-propagating its own micro batches, sum to the one-rank gradient.
- The loss's hyper-parameters are one frozen :class:`~stream_rl.algorithms.LossSpec`, built from ``trainer.loss``
  once per update (``LossSpec.from_config``); the loss kind selects its registered surrogate, nothing here branches
  on it.
- Off-policy correction weights the KL-in-loss term like the policy term: each token by the same importance weight
  pi_prox / mu at the loss kind's level (the sequence weight for GSPO), so both are expectations under pi_prox.
- NaN/Inf guard: a non-finite micro loss is back-propagated as NaN, so the (global) gradient norm is not finite and
  the engine skips the update on every rank, through the path ZeRO itself uses for overflows; a non-finite
  gradient norm alone does the same. Either way the weights and the optimizer state are untouched. The remaining
  micro batches still run, so the ranks stay in lockstep.
- Metrics are reduced over ranks as over micro batches (shares summed, ``*_max`` / ``*_min`` by max / min).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from consumers.trainer.config import TrainerConfig
from consumers.trainer.forward import response_logprobs
from consumers.trainer.micro import micro_batches
from consumers.trainer.targets import BatchTargets
from consumers.trainer.tensors import RolloutBatch
from stream_rl import algorithms as alg

if TYPE_CHECKING:
    from consumers.trainer.engines import TrainEngine

log = logging.getLogger(__name__)


@dataclass
class ForwardRecord:
    """pi_prox logprobs and entropy ``[B, T]`` read off the single update's forwards (when no proximal pass ran)."""

    logp: Tensor
    entropy: Tensor
    seen: Tensor  # [B] bool: rows whose forward ran

    @classmethod
    def empty(cls, batch: RolloutBatch) -> ForwardRecord:
        shape, device = batch.response_ids.shape, batch.device
        return cls(torch.zeros(shape, device=device), torch.zeros(shape, device=device),
                   torch.zeros(batch.size, dtype=torch.bool, device=device))

    def gather(self, ranks) -> None:
        """Every rank's recorded rows, on every rank (each row was recorded by exactly one rank)."""
        self.logp, self.entropy = ranks.sum_(self.logp), ranks.sum_(self.entropy)
        seen = ranks.sum_(self.seen.to(torch.float32))
        if not bool((seen == 1).all()):
            raise RuntimeError(f"the single update recorded {int((seen == 1).sum())} of {seen.numel()} rows once")
        self.seen = seen.bool()


def _is_weights(prox_logp: Tensor, sub: RolloutBatch, cfg: TrainerConfig, spec: alg.LossSpec) -> Tensor | None:
    """The policy term's importance weights ``[b, T]`` at the loss kind's level (None without off-policy
    correction)."""
    if not cfg.loss.off_policy_correction:
        return None
    weights, _ = alg.importance_weights(prox_logp, sub.behavior_logp, sub.response_mask, is_cap=spec.is_cap,
                                        is_mode=spec.is_mode, level=spec.level)
    return weights


def micro_loss(engine: TrainEngine, sub: RolloutBatch, tg: BatchTargets, idx: Tensor, cfg: TrainerConfig,
               kl_coef: float, normaliser: Tensor, spec: alg.LossSpec,
               record: ForwardRecord | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro batch's share of the minibatch loss (policy + KL-in-loss + value), over ``normaliser``."""
    logp, ent, values = response_logprobs(engine, sub, entropy=record is not None)
    mask = sub.response_mask
    prox = tg.prox_logp[idx] if tg.prox_logp is not None else logp.detach()  # [b, T]
    if record is not None:
        assert ent is not None  # entropy=True when there is a record
        record.logp[idx], record.entropy[idx], record.seen[idx] = prox.float(), ent.float(), True
    common = {"agg": spec.agg, "max_len": spec.max_len, "normaliser": normaliser}
    behavior = sub.behavior_logp if cfg.loss.off_policy_correction else None
    loss, metrics = alg.policy_loss(logp, prox, tg.advantages[idx], mask, spec, behavior_logp=behavior,
                                    normaliser=normaliser)
    metrics = {f"policy/{k}": v for k, v in metrics.items()}
    metrics["loss/policy"] = loss.detach()
    if cfg.kl.placement == "loss" and kl_coef > 0:
        kl = alg.kl_loss(logp, sub.ref_logp, mask, kind=cfg.kl.kind, weights=_is_weights(prox, sub, cfg, spec),
                         **common)
        loss = loss + kl_coef * kl
        metrics["loss/kl"] = kl.detach()
    if tg.returns is not None:
        assert values is not None and tg.old_values is not None  # returns come with the value head (gae)
        v_loss, v_metrics = alg.value_loss(values, tg.old_values[idx], tg.returns[idx], mask, clip=cfg.value_clip,
                                           **common)
        loss = loss + cfg.vf_coef * v_loss
        metrics.update({f"value/{k}": v for k, v in v_metrics.items()})
        metrics["loss/value"] = v_loss.detach()
    return loss, metrics


def merge(acc: dict[str, float], metrics: dict[str, Tensor | float], weight: float) -> None:
    """Fold one part's metrics into ``acc``: ``*_max`` by max, ``*_min`` by min, ``loss/*`` summed (each part is
    already its share of the loss), everything else weighted by ``weight``."""
    for key, value in metrics.items():
        v = float(value)
        if key.endswith("_max"):
            acc[key] = max(acc.get(key, -math.inf), v)
        elif key.endswith("_min"):
            acc[key] = min(acc.get(key, math.inf), v)
        else:
            acc[key] = acc.get(key, 0.0) + (v if key.startswith("loss/") else weight * v)


def update(engine: TrainEngine, batch: RolloutBatch, tg: BatchTargets, rows: Tensor, cfg: TrainerConfig, kl_coef: float,
           lr: float, record: ForwardRecord | None = None) -> tuple[bool, float, dict[str, float]]:
    """One optimizer update on the minibatch ``rows``; returns (applied, grad norm, metrics); after a non-finite
    loss: (False, nan, {"loss/total": that loss})."""
    spec = alg.LossSpec.from_config(cfg.loss)  # built once per update; checked when built
    total = alg.loss_normaliser(batch.response_mask[rows], spec.agg, max_len=spec.max_len)
    micros = micro_batches(engine.ranks, batch, rows, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch,
                           packed=engine.module.packing)
    acc: dict[str, float] = {}
    bad: float | None = None
    for i, (idx, real) in enumerate(micros):
        sub = batch.select(idx)
        loss, metrics = micro_loss(engine, sub, tg, idx, cfg, kl_coef, total, spec, record if real else None)
        if not bool(torch.isfinite(loss)):
            log.warning("non-finite loss %s in micro batch %d: update skipped, gradients discarded",
                        float(loss.detach()), i)
            bad = float(loss.detach())
            loss = loss * math.nan  # NaN gradients: the engine's finite-norm guard skips the update on every rank
        engine.backward(loss if real else loss * 0.0, last_micro=i == len(micros) - 1)
        if real:
            share = float(alg.loss_normaliser(sub.response_mask, spec.agg, max_len=spec.max_len) / total)
            merge(acc, {**metrics, "loss/total": loss.detach()}, share)
    parts = engine.ranks.gather_json({"metrics": acc, "bad": bad})
    outcome = engine.step(lr)
    bad = next((p["bad"] for p in parts if p["bad"] is not None), None)
    if bad is not None:
        return False, math.nan, {"loss/total": bad}  # reported: alerts watch loss/total
    if not outcome.applied:
        log.warning("non-finite gradient norm %s: update skipped, gradients discarded", outcome.grad_norm)
    acc = {}
    for part in parts:
        merge(acc, part["metrics"], 1.0)
    return outcome.applied, outcome.grad_norm, acc
