"""The math of the trainer: advantages, policy and value losses, KL, off-policy correction, staleness.

Pure functions over torch tensors, one formula each, with the formula and a reference in every docstring and the
full list in ``docs/algorithms.md``. No Kafka, no I/O, no module state (the KL controllers only hold their current
coefficient). Conventions:

- token tensors are ``[B, T]`` with a response ``mask`` ``[B, T]`` (bool or 0/1; 1 = response token; valid tokens
  form a prefix of each row); per-sequence tensors are ``[B]``;
- every output is 0 at masked positions, and what masked positions hold never reaches a loss or a gradient;
- losses return ``(loss, metrics)`` where ``metrics`` maps plain names (``clipfrac``, ``approx_kl``...) to 0-dim
  detached tensors: call ``.item()`` (once per step) when logging them;
- bad arguments raise ``ValueError`` naming the argument;
- the three policies are named the same everywhere: ``logp`` (pi_theta, being trained), ``prox_logp`` (pi_prox, the
  proximal policy the ratio is taken against) and ``behavior_logp`` (mu, the generator's); the reference is
  ``ref_logp``.
"""

from .advantages import (grpo_advantages, reinforce_pp_advantages, rloo_advantages, sequence_to_tokens,
                         whiten_advantages)
from .reductions import AGG_MODES, aggregate, loss_normaliser, masked_mean, masked_sum
from .kl import (KL_KINDS, KL_LOSS_KINDS, AdaptiveKLController, FixedKLController, adaptive_kl_coef, kl_loss,
                 kl_penalty)
from .logprobs import entropy_from_logits, logprobs_from_logits
from .offpolicy import IS_LEVELS, IS_MODES, importance_weights
from .policy import POLICY_LOSS_DEFAULTS, POLICY_LOSS_KINDS, clipped_surrogate, policy_loss
from .returns import discounted_returns, gae
from .shaping import overlong_keep, overlong_penalty, zero_variance_groups
from .staleness import max_lag_filter, policy_lag
from .value import value_loss

__all__ = [
    "AGG_MODES",
    "IS_LEVELS",
    "IS_MODES",
    "KL_KINDS",
    "KL_LOSS_KINDS",
    "POLICY_LOSS_DEFAULTS",
    "POLICY_LOSS_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "adaptive_kl_coef",
    "aggregate",
    "clipped_surrogate",
    "discounted_returns",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "importance_weights",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "loss_normaliser",
    "masked_mean",
    "masked_sum",
    "max_lag_filter",
    "overlong_keep",
    "overlong_penalty",
    "policy_lag",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_to_tokens",
    "value_loss",
    "whiten_advantages",
    "zero_variance_groups",
]
