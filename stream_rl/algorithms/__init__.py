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
  proximal policy the ratio is taken against) and ``behavior_logp`` (mu, the producer's); the reference is
  ``ref_logp``.

The catalogue of choices (``catalogue.py``) and the loss spec (``spec.py``) import no torch, so a config can use
them without it; every other name is imported from its module on first use (PEP 562 ``__getattr__``).
"""

from importlib import import_module

from .catalogue import AGG_MODES, IS_MODES, KL_KINDS, KL_LOSS_KINDS
from .spec import LossSpec

_LAZY = {  # name -> module: the torch-using modules load on first access
    **dict.fromkeys(("grpo_advantages", "reinforce_pp_advantages", "rloo_advantages", "sequence_to_tokens",
                     "whiten_advantages"), "advantages"),
    **dict.fromkeys(("aggregate", "loss_normaliser", "masked_mean", "masked_sum"), "reductions"),
    **dict.fromkeys(("AdaptiveKLController", "FixedKLController", "adaptive_kl_coef", "kl_loss", "kl_penalty"), "kl"),
    **dict.fromkeys(("entropy_from_logits", "logprobs_from_logits"), "logprobs"),
    **dict.fromkeys(("IS_LEVELS", "importance_weights"), "offpolicy"),
    **dict.fromkeys(("POLICY_LOSS_DEFAULTS", "POLICY_LOSS_KINDS", "policy_loss"), "policy"),
    **dict.fromkeys(("SURROGATES", "clipped_surrogate", "register_surrogate", "surrogate_for"), "surrogates"),
    **dict.fromkeys(("discounted_returns", "gae"), "returns"),
    **dict.fromkeys(("overlong_keep", "overlong_penalty", "zero_variance_groups"), "shaping"),
    **dict.fromkeys(("max_lag_filter", "policy_lag"), "staleness"),
    "value_loss": "value",
}


def __getattr__(name: str):
    """Import ``name`` from its torch-using module on first access (then it is a plain module attribute)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AGG_MODES",
    "IS_LEVELS",
    "IS_MODES",
    "KL_KINDS",
    "KL_LOSS_KINDS",
    "POLICY_LOSS_DEFAULTS",
    "POLICY_LOSS_KINDS",
    "SURROGATES",
    "AdaptiveKLController",
    "FixedKLController",
    "LossSpec",
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
    "register_surrogate",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_to_tokens",
    "surrogate_for",
    "value_loss",
    "whiten_advantages",
    "zero_variance_groups",
]
