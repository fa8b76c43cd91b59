"""The clipped policy-gradient loss: PPO, its clip-higher and dual-clip variants, GSPO, and off-policy correction.

Consumes: ``logp`` ``[B, T]`` (pi_theta, the current policy, with gradient), ``prox_logp`` ``[B, T]`` (pi_prox, the
policy the ratio is taken against: the trainer's proximal recomputation before the batch's first update, or the
sampler's logprobs when generation is on-policy), ``advantages`` ``[B, T]`` and the response mask; optionally
``behavior_logp`` ``[B, T]`` (mu, the generator's logprobs).
Produces: ``(loss, metrics)``: a 0-dim loss to minimise and a dict of 0-dim detached tensors (call ``.item()``).
Guarantees: masked positions never change the loss or its gradient; with logp == prox_logp and no behaviour
logprobs the per-token loss is exactly -A, whose gradient is that of -A * logp.

Per-token loss (kind="ppo"), with the paper names of CleanRL / Schulman et al. 2017:

    ratio    = exp(logp - prox_logp)
    pg_loss1 = -A * ratio
    pg_loss2 = -A * clip(ratio, 1 - clip_low, 1 + clip_high)
    pg_loss  = max(pg_loss1, pg_loss2)
    dual clip (c > 1): pg_loss = min(pg_loss, -c * A) where A < 0

kind="gspo" uses one ratio per sequence, s = exp(mean_{t valid} (logp_t - prox_logp_t)), clipped the same way against
the advantage of the sequence's first valid token; every valid token carries its sequence's loss. Its ratio stays
within ~1e-3 of 1, so it has its own defaults (:data:`POLICY_LOSS_DEFAULTS`: the paper's clip 3e-4 / 4e-4 and
``seq-mean-token-mean``), and its importance weight is the sequence-level one (geometric mean of the token weights).
Off-policy (``behavior_logp`` given): every token's loss is multiplied by the constant importance weight of
:func:`~stream_rl.algorithms.offpolicy.importance_weights` (decoupled PPO / truncated IS).
The per-token loss is then reduced with :func:`~stream_rl.algorithms.reductions.aggregate` (``agg``).

Numerical guard: the log-ratio is clamped to [-20, 20] before ``exp`` (as verl does) so an outlier token cannot
produce inf * 0 = NaN gradients; at |log-ratio| > 20 the ratio is far outside any clip range anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_choice, check_float, check_positive, check_same_shape
from .reductions import AGG_MODES, aggregate, masked_mean
from .kl import kl_penalty
from .offpolicy import IS_MODES, importance_weights

POLICY_LOSS_KINDS: tuple[str, ...] = ("ppo", "gspo")
POLICY_LOSS_DEFAULTS: dict[str, dict[str, float | str]] = {
    "ppo": {"clip_low": 0.2, "clip_high": 0.2, "agg": "token-mean"},  # Schulman et al. 2017; DAPO's token mean
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "agg": "seq-mean-token-mean"},  # Zheng et al. 2025 (GSPO)
}
MAX_LOG_RATIO = 20.0


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Elementwise PPO surrogate loss; returns ``(pg_loss, clipped, dual_clipped)`` of the shape of ``ratio``.

    Formula: pg_loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)), then, with c = ``dual_clip``,
    pg_loss = min(pg_loss, -c * A) where A < 0. ``clipped`` marks where the clipped term is strictly larger
    (the gradient is cut), ``dual_clipped`` where the dual clip is active.
    References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7; Yu et al. 2025, "DAPO"
    (decoupled clip_low / clip_high, "clip-higher"); Ye et al. 2020, "Mastering Complex Control in MOBA Games with
    Deep Reinforcement Learning" (dual clip).
    """
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)
    clipped = pg_loss2 > pg_loss1
    if dual_clip is None:
        return pg_loss, clipped, torch.zeros_like(clipped)
    pg_loss3 = -dual_clip * advantages
    dual_clipped = (advantages < 0) & (pg_loss3 < pg_loss)
    return torch.where(dual_clipped, pg_loss3, pg_loss), clipped, dual_clipped


def _check_hyper(
    kind: str, clip_low: float, clip_high: float, dual_clip: float | None, is_cap: float | None, is_mode: str,
    agg: str, off_policy: bool,
) -> None:
    """Raise ValueError naming the first invalid hyper-parameter of :func:`policy_loss`."""
    check_choice(kind, "kind", POLICY_LOSS_KINDS)
    check_choice(agg, "agg", AGG_MODES)
    check_choice(is_mode, "is_mode", IS_MODES)
    if not 0.0 < float(clip_low) <= 1.0:
        raise ValueError(f"clip_low must be in (0, 1], got {clip_low}")
    check_positive(clip_high, "clip_high")
    if dual_clip is not None and not float(dual_clip) > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    if is_cap is not None:
        check_positive(is_cap, "is_cap")
        if not off_policy:
            raise ValueError("is_cap needs behavior_logp: there is no importance weight to cap without it")


def _sequence_ratio(log_ratio: Tensor, advantages: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """GSPO: s_b = exp(mean of the valid log-ratios of row b) and the advantage of its first valid token, both [B]."""
    lengths = m.sum(-1).clamp_min(1).to(log_ratio.dtype)  # [B]
    seq_log_ratio = (log_ratio.sum(-1) / lengths).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [B]; log_ratio is 0 if masked
    first = m.int().argmax(-1, keepdim=True)  # [B, 1]; index of the first valid token (0 if none)
    return seq_log_ratio.exp(), advantages.gather(-1, first).squeeze(-1)  # [B], [B]


def _surrogate(kind: str, log_ratio: Tensor, advantages: Tensor, m: Tensor, clip_low: float, clip_high: float,
               dual_clip: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(ratio, pg_loss, clipped, dual_clipped), each ``[B, T]``: per token (ppo), or per sequence on its tokens."""
    if kind == "ppo":
        ratio = log_ratio.exp()  # [B, T]
        return (ratio, *clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip))
    seq_ratio, seq_adv = _sequence_ratio(log_ratio, advantages, m)  # [B], [B]
    seq_loss, seq_clipped, seq_dual = clipped_surrogate(seq_ratio, seq_adv, clip_low, clip_high, dual_clip)
    return tuple(x[:, None].expand_as(m) for x in (seq_ratio, seq_loss, seq_clipped, seq_dual))  # [B, T] each


def policy_loss(
    logp: Tensor,
    prox_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kind: str = "ppo",
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    behavior_logp: Tensor | None = None,
    is_cap: float | None = None,
    is_mode: str = "clamp",
    agg: str | None = None,
    max_len: int | None = None,
    normaliser: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss (formulas in the module docstring); returns ``(loss, metrics)``.

    ``kind``: "ppo" (per-token ratio; Schulman et al. 2017) or "gspo" (per-sequence ratio; Zheng et al. 2025,
    "Group Sequence Policy Optimization"). ``clip_low`` in (0, 1], ``clip_high`` > 0 (clip-higher when larger),
    ``agg`` one of :data:`~stream_rl.algorithms.reductions.AGG_MODES`: None takes ``POLICY_LOSS_DEFAULTS[kind]``.
    ``dual_clip`` > 1 or None. ``behavior_logp`` switches on off-policy correction with weights
    w = exp(prox_logp - behavior_logp) (per token; per sequence, their geometric mean, for gspo), capped at
    ``is_cap`` by ``is_mode`` "clamp" or "mask" (Fu et al. 2025, AReaL). ``max_len`` and ``normaliser`` are passed to
    :func:`~stream_rl.algorithms.reductions.aggregate` (the generation budget of Dr. GRPO; a whole batch's normaliser
    for a micro batch).

    ``metrics``: ``clipfrac`` (fraction of valid tokens whose clipped term is active), ``approx_kl`` (k3 estimate of
    KL(prox || new) over valid tokens), ``ratio_mean``, ``ratio_min``, ``ratio_max`` (of the ratio the surrogate used:
    per token for ppo, the sequence ratio on each token for gspo), ``dual_clipfrac`` when ``dual_clip`` is set, and
    ``is_weight_mean``, ``is_weight_max``, ``is_clipped_frac`` when ``behavior_logp`` is given.
    """
    logp = check_float(logp, "logp", ndim=2)
    check_same_shape(logp, "logp", prox_logp=prox_logp, advantages=advantages, behavior_logp=behavior_logp)
    prox_logp, advantages = check_float(prox_logp, "prox_logp"), check_float(advantages, "advantages")
    m = as_bool_mask(mask, logp, "logp")
    check_choice(kind, "kind", POLICY_LOSS_KINDS)
    clip_low, clip_high, agg = (POLICY_LOSS_DEFAULTS[kind][name] if value is None else value
                                for name, value in (("clip_low", clip_low), ("clip_high", clip_high), ("agg", agg)))
    _check_hyper(kind, clip_low, clip_high, dual_clip, is_cap, is_mode, agg, behavior_logp is not None)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp, prox_logp = torch.where(m, logp, zero), torch.where(m, prox_logp.detach(), zero)  # [B, T]
    advantages = torch.where(m, advantages.detach(), zero)  # [B, T]
    log_ratio = (logp - prox_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [B, T]
    ratio, pg_loss, clipped, dual_clipped = _surrogate(kind, log_ratio, advantages, m, clip_low, clip_high, dual_clip)
    metrics: dict[str, Tensor] = {}
    if behavior_logp is not None:
        level = "token" if kind == "ppo" else "sequence"
        weights, metrics = importance_weights(prox_logp, behavior_logp, m, is_cap=is_cap, is_mode=is_mode,
                                              level=level)
        pg_loss = pg_loss * weights  # [B, T]
    loss = aggregate(torch.where(m, pg_loss, zero), m, agg, max_len=max_len, normaliser=normaliser)
    with torch.no_grad():
        metrics = {**_ratio_metrics(ratio, logp, prox_logp, clipped, m), **metrics}
        if dual_clip is not None:
            metrics["dual_clipfrac"] = masked_mean(dual_clipped.to(logp.dtype), m)
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
