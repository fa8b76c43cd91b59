"""The clipped value (critic) loss of PPO.

Consumes: ``values`` ``[B, T]`` (current critic, with gradient), ``old_values`` ``[B, T]`` (the critic that produced
the GAE targets), ``returns`` ``[B, T]`` (the targets, e.g. from :func:`~stream_rl.algorithms.returns.gae`) and the
response mask.
Produces: ``(loss, metrics)``: a 0-dim loss and a dict of 0-dim detached tensors.
Guarantees: masked positions never change the loss or its gradient.

Formula (Schulman et al. 2017 as implemented in OpenAI baselines' ppo2; the paper names of CleanRL):

    vf_loss1 = (V - R)^2
    V_clipped = old_V + clip(V - old_V, -clip, clip)
    vf_loss2 = (V_clipped - R)^2
    vf_loss  = 0.5 * max(vf_loss1, vf_loss2)

``clip=None`` turns clipping off (vf_loss = 0.5 * vf_loss1). The per-token loss is reduced with
:func:`~stream_rl.algorithms.reductions.aggregate`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_choice, check_float, check_positive, check_same_shape
from .reductions import AGG_MODES, aggregate, masked_mean


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    *,
    max_len: int | None = None,
    normaliser: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss 0.5 * max((V - R)^2, (old_V + clip(V - old_V, -clip, clip) - R)^2), aggregated by ``agg``.

    Reference: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (value clipping as in OpenAI
    baselines' ppo2; Ouyang et al. 2022 use it for the RLHF critic). ``clip`` > 0 or None (no clipping);
    ``agg`` one of :data:`~stream_rl.algorithms.reductions.AGG_MODES`; ``max_len`` and ``normaliser`` are passed to
    :func:`~stream_rl.algorithms.reductions.aggregate`.

    ``metrics``: ``vf_clipfrac`` (fraction of valid tokens where the clipped term is strictly larger),
    ``values_mean``, ``returns_mean`` and ``vf_explained_var`` = 1 - Var(R - V) / Var(R) over valid tokens
    (0 when Var(R) = 0).
    """
    values = check_float(values, "values", ndim=2)
    check_same_shape(values, "values", old_values=old_values, returns=returns)
    old_values, returns = check_float(old_values, "old_values"), check_float(returns, "returns")
    m = as_bool_mask(mask, values, "values")
    check_choice(agg, "agg", AGG_MODES)
    clip = None if clip is None else check_positive(clip, "clip")
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(m, values, zero)  # [B, T]
    old_values = torch.where(m, old_values.detach(), zero)  # [B, T]
    returns = torch.where(m, returns.detach(), zero)  # [B, T]
    vf_loss1 = (values - returns).square()  # [B, T]
    if clip is None:
        vf_loss, clipped = 0.5 * vf_loss1, torch.zeros_like(m)
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip, clip)  # [B, T]
        vf_loss2 = (values_clipped - returns).square()  # [B, T]
        vf_loss, clipped = 0.5 * torch.maximum(vf_loss1, vf_loss2), vf_loss2 > vf_loss1  # [B, T]
    loss = aggregate(vf_loss, m, agg, max_len=max_len, normaliser=normaliser)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean(clipped.to(values.dtype), m),
            "values_mean": masked_mean(values.detach(), m),
            "returns_mean": masked_mean(returns, m),
            "vf_explained_var": _explained_variance(values.detach(), returns, m),
        }
    return loss, metrics


def _explained_variance(values: Tensor, returns: Tensor, m: Tensor) -> Tensor:
    """1 - Var(R - V) / Var(R) over valid tokens (population variances); 0 when Var(R) == 0."""
    def var(x: Tensor) -> Tensor:
        return masked_mean((x - masked_mean(x, m)).square(), m)

    var_returns = var(returns)
    ratio = var(returns - values) / torch.where(var_returns > 0, var_returns, torch.ones_like(var_returns))
    return torch.where(var_returns > 0, 1.0 - ratio, torch.zeros_like(ratio))
