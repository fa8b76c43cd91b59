"""The policy-gradient loss: a registered per-kind surrogate (PPO, GSPO, CISPO), off-policy weights, aggregation.

Consumes: ``logp`` ``[B, T]`` (pi_theta, the current policy, with gradient), ``prox_logp`` ``[B, T]`` (pi_prox, the
policy the ratio is taken against: the trainer's proximal recomputation before the batch's first update, or the
sampler's logprobs when generation is on-policy), ``advantages`` ``[B, T]``, the response mask and a
:class:`~stream_rl.algorithms.spec.LossSpec`; optionally ``behavior_logp`` ``[B, T]`` (mu, the producer's logprobs).
Produces: ``(loss, metrics)``: a 0-dim loss to minimise and a dict of 0-dim detached tensors (call ``.item()``).
Guarantees: masked positions never change the loss or its gradient; with logp == prox_logp and no behaviour
logprobs the gradient is that of -A * logp for every kind (the per-token loss of ppo and gspo is then exactly -A).

The per-token loss is the surrogate registered for ``spec.kind`` (``surrogates.py``, one function per kind, formula
in its docstring; the catalogue row in ``catalogue.py`` holds its defaults, level and citation):

    ppo   (Schulman et al. 2017)  ratio = exp(logp - prox_logp),
          pg_loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)); dual clip (c > 1):
          pg_loss = min(pg_loss, -c * A) where A < 0
    gspo  (Zheng et al. 2025)     the same clip on one length-normalised ratio per sequence, against the advantage of
          the sequence's first valid token; its ratio stays within ~1e-3 of 1, hence the paper's clip 3e-4 / 4e-4
    cispo (MiniMax-M1, 2025)      pg_loss = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logp

Off-policy (``behavior_logp`` given): every token's loss is multiplied by the constant importance weight of
:func:`~stream_rl.algorithms.offpolicy.importance_weights` at the kind's level (per token; per sequence, the
geometric mean of the token weights, for gspo): decoupled PPO / truncated IS.
The per-token loss is then reduced with :func:`~stream_rl.algorithms.reductions.aggregate` (``spec.agg``).

Numerical guard: the log-ratio is clamped to [-20, 20] before ``exp`` (as verl does) so an outlier token cannot
produce inf * 0 = NaN gradients; at |log-ratio| > 20 the ratio is far outside any clip range anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_float, check_same_shape
from .catalogue import LOSS_DEFAULTS, LOSS_KIND_NAMES
from .kl import kl_penalty
from .offpolicy import importance_weights
from .reductions import aggregate, masked_mean
from .spec import LossSpec
from .surrogates import MAX_LOG_RATIO, SurrogateInputs, surrogate_for

POLICY_LOSS_KINDS: tuple[str, ...] = LOSS_KIND_NAMES  # the catalogue's (catalogue.py)
POLICY_LOSS_DEFAULTS: dict[str, dict[str, float | str]] = LOSS_DEFAULTS
DEFAULT_SPEC = LossSpec()  # ppo with its catalogue defaults


def policy_loss(
    logp: Tensor,
    prox_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    spec: LossSpec = DEFAULT_SPEC,
    behavior_logp: Tensor | None = None,
    normaliser: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient loss of ``spec.kind`` (formulas in the module docstring); returns ``(loss, metrics)``.

    ``spec``: a :class:`~stream_rl.algorithms.spec.LossSpec` (kind, clip range, dual clip, IS cap and mode, agg,
    max_len; checked when it was built); the default is ppo with its catalogue defaults. ``behavior_logp`` switches on
    off-policy correction with weights w = pi_prox / mu at the kind's level, capped at ``spec.is_cap`` by
    ``spec.is_mode`` (Fu et al. 2025, AReaL); ``spec.is_cap`` without ``behavior_logp`` raises ValueError.
    ``normaliser``: a whole batch's normaliser for a micro batch (:func:`~stream_rl.algorithms.reductions.aggregate`).

    ``metrics``: ``clipfrac`` (fraction of valid tokens the kind's clip acted on), ``approx_kl`` (k3 estimate of
    KL(prox || new) over valid tokens), ``ratio_mean``, ``ratio_min``, ``ratio_max`` (of the ratio the surrogate used:
    per token, or the sequence ratio on each token for gspo), ``dual_clipfrac`` when ``spec.dual_clip`` is set, and
    ``is_weight_mean``, ``is_weight_max``, ``is_clipped_frac`` when ``behavior_logp`` is given.
    """
    logp = check_float(logp, "logp", ndim=2)
    check_same_shape(logp, "logp", prox_logp=prox_logp, advantages=advantages, behavior_logp=behavior_logp)
    prox_logp, advantages = check_float(prox_logp, "prox_logp"), check_float(advantages, "advantages")
    m = as_bool_mask(mask, logp, "logp")
    if not isinstance(spec, LossSpec):
        raise ValueError(f"spec must be a LossSpec, got {type(spec).__name__}")
    if spec.is_cap is not None and behavior_logp is None:
        raise ValueError("is_cap needs behavior_logp: there is no importance weight to cap without it")
    surrogate = surrogate_for(spec.kind)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp, prox_logp = torch.where(m, logp, zero), torch.where(m, prox_logp.detach(), zero)  # [B, T]
    advantages = torch.where(m, advantages.detach(), zero)  # [B, T]
    log_ratio = (logp - prox_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [B, T]
    out = surrogate(SurrogateInputs(logp, log_ratio, advantages, m), spec)
    pg_loss, metrics = out.pg_loss, dict[str, Tensor]()
    if behavior_logp is not None:
        weights, metrics = importance_weights(prox_logp, behavior_logp, m, is_cap=spec.is_cap,
                                              is_mode=spec.is_mode, level=spec.level)
        pg_loss = pg_loss * weights  # [B, T]
    loss = aggregate(torch.where(m, pg_loss, zero), m, spec.agg, max_len=spec.max_len, normaliser=normaliser)
    with torch.no_grad():
        metrics = {**_ratio_metrics(out.ratio, logp, prox_logp, out.clipped, m), **metrics}
        if out.dual_clipped is not None:
            metrics["dual_clipfrac"] = masked_mean(out.dual_clipped.to(logp.dtype), m)
    return loss, metrics


def _ratio_metrics(
    ratio: Tensor, logp: Tensor, prox_logp: Tensor, clipped: Tensor, m: Tensor,
) -> dict[str, Tensor]:
    """clipfrac, approx_kl (k3 of KL(prox || new)) and ratio statistics over valid tokens, as detached 0-dim tensors."""
    ratio = ratio.detach()
    any_valid = m.any()
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    inf = torch.full((), float("inf"), dtype=ratio.dtype, device=ratio.device)
    if ratio.numel() == 0:  # no tokens at all: min/max of an empty tensor would raise
        return {key: zero.clone() for key in ("clipfrac", "approx_kl", "ratio_mean", "ratio_min", "ratio_max")}
    return {
        "clipfrac": masked_mean(clipped.to(ratio.dtype), m),
        "approx_kl": masked_mean(kl_penalty(prox_logp.detach(), logp.detach(), "k3", mask=m), m),
        "ratio_mean": masked_mean(ratio, m),
        "ratio_min": torch.where(any_valid, torch.where(m, ratio, inf).min(), zero),
        "ratio_max": torch.where(any_valid, torch.where(m, ratio, zero).max(), zero),  # ratio > 0
    }
