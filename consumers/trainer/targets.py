"""What every update of a batch trains towards: advantages (and GAE returns), and the KL to the reference.

Consumes: a :class:`~consumers.trainer.tensors.RolloutBatch`, the trainer config, the current KL coefficient and,
where the estimator needs them, the proximal pass's logprobs and values.
Produces: :class:`BatchTargets` (``[B, T]`` tensors, constants for autograd) for :mod:`consumers.trainer.update`.
Guarantees: every formula comes from ``stream_rl.algorithms``; advantages are computed (and, with
``trainer.whiten_advantages``, whitened) once over the whole batch, never per micro batch.

Rewards: sequence estimators (grpo, dr_grpo, rloo) use the scalar ``reward``; token estimators (reinforce_pp,
gae) use the scorer's ``token_rewards`` when it sent them (the dense form of the whole reward, as the scorer
builds it) and otherwise the scalar ``reward`` on the last response token. With ``kl.placement == "reward"`` the
penalty beta * KL_t (of pi_prox against the reference, estimator ``kl.kind``) is taken from the token rewards
(and its sum from the scalar reward). DAPO's soft overlong penalty (``trainer.overlong.buffer``) is added to the
scalar reward and on the last policy token; overlong filtering (``trainer.overlong.filter``) acts on the loss only
(:func:`loss_batch`), after the targets were computed over the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from consumers.trainer.config import TrainerConfig
from consumers.trainer.tensors import RolloutBatch
from stream_rl import algorithms as alg


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


def last_index(mask: Tensor) -> Tensor:
    """``[B]`` index of the last True of each row of ``mask`` ``[B, T]`` (T - 1 for a row without one): the last
    response token, or in a multi-turn rollout the last token the policy sampled."""
    width = mask.shape[-1]
    return width - 1 - mask.flip(-1).to(torch.int8).argmax(-1)  # [B]


def length_penalty(batch: RolloutBatch, cfg: TrainerConfig) -> Tensor:
    """DAPO's soft overlong punishment of each rollout ``[B]`` (zeros without ``trainer.overlong.buffer``)."""
    overlong = cfg.overlong
    if overlong.buffer is None:
        return torch.zeros_like(batch.rewards)
    lengths = batch.response_lengths  # [B] the policy's and the environment's tokens: the length budget's count
    return alg.overlong_penalty(lengths, overlong.max_len, overlong.buffer, overlong.factor).to(batch.rewards)


def advantage_inputs(batch: RolloutBatch, kl_t: Tensor | None, kl_coef: float, cfg: TrainerConfig,
                     values: Tensor | None) -> AdvantageInputs:
    """Rewards for the estimators: the overlong penalty added on the last token, beta * KL_t subtracted when the
    KL goes into the reward."""
    mask = batch.response_mask
    in_reward = cfg.kl.placement == "reward" and kl_t is not None
    penalty = kl_coef * kl_t if kl_t is not None and in_reward else torch.zeros_like(batch.token_rewards)  # [B, T]
    last = last_index(mask)  # [B] the last token the policy sampled
    rows = torch.arange(batch.size, device=mask.device)  # [B]
    shaping = length_penalty(batch, cfg)  # [B]
    shaped = batch.rewards + shaping  # [B]
    terminal = torch.zeros_like(batch.token_rewards)  # [B, T]
    terminal[rows, last] = shaped
    dense = batch.token_rewards.clone()  # [B, T]
    dense[rows, last] += shaping
    token_rewards = torch.where(batch.has_token_rewards[:, None], dense, terminal)  # [B, T]
    token_rewards = torch.where(mask, token_rewards - penalty, 0.0)  # [B, T]
    rewards = shaped - alg.masked_sum(penalty, mask, dim=-1)  # [B]
    return AdvantageInputs(rewards, token_rewards, mask, batch.group_ids, values, cfg.gamma, cfg.lam)


def loss_batch(batch: RolloutBatch, cfg: TrainerConfig) -> RolloutBatch:
    """The batch the loss sees: with ``trainer.overlong.filter``, truncated rollouts leave the response mask
    (DAPO's overlong filtering; the targets were computed on the whole batch). Otherwise ``batch`` itself."""
    if not cfg.overlong.filter or not bool(batch.truncated.any()):
        return batch
    keep = alg.overlong_keep(batch.truncated)  # [B]
    return replace(batch, response_mask=batch.response_mask & keep[:, None])


def require_refs(batch: RolloutBatch, kl_coef: float) -> None:
    """A KL penalty needs reference logprobs on every rollout: raise ValueError naming the fix otherwise."""
    if kl_coef > 0 and not bool(batch.has_ref.all()):
        missing = int((~batch.has_ref).sum())
        raise ValueError(f"trainer.kl.coef > 0 but {missing} of {batch.size} rollouts carry no ref_logprobs: "
                         f"give the scorer a reference model or set trainer.kl.coef = 0")


def kl_to_reference(batch: RolloutBatch, prox_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate ``[B, T]`` of pi_prox vs the reference (0 where no reference logprobs came)."""
    mask = batch.response_mask & batch.has_ref[:, None]
    return alg.kl_penalty(prox_logp, batch.ref_logp, kind, mask=mask)  # [B, T]


@dataclass(frozen=True)
class BatchTargets:
    """Per-batch constants of every update, ``[B, T]`` each (returns/old_values only for gae).

    ``prox_logp`` None: there is a single update and its own forward gives pi_prox (the ratio is exactly 1).
    """

    prox_logp: Tensor | None
    advantages: Tensor
    returns: Tensor | None
    old_values: Tensor | None


def batch_advantages(batch: RolloutBatch, cfg: TrainerConfig, kl_coef: float, kl_t: Tensor | None,
                     values: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Advantages ``[B, T]`` (whitened over the batch when ``cfg.whiten_advantages``) and GAE returns (or None)."""
    advantages, returns = ADVANTAGE_ESTIMATORS[cfg.advantage](advantage_inputs(batch, kl_t, kl_coef, cfg, values))
    if cfg.whiten_advantages:
        advantages = alg.whiten_advantages(advantages, batch.response_mask)  # [B, T]
    return advantages, returns
