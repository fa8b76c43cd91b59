"""Per-token policy-gradient surrogates, one pure function per loss kind, registered by the kind's name.

Consumes: :class:`SurrogateInputs` (``logp`` pi_theta with gradient, the clamped ``log_ratio`` log(pi_theta /
pi_prox), the detached ``advantages`` and the bool ``mask``, each ``[B, T]`` and 0 at masked positions) and the
:class:`~stream_rl.algorithms.spec.LossSpec`.
Produces: a :class:`Surrogate`: the ratio the kind used, the per-token loss and the masks of clipped tokens, each
``[B, T]``; :func:`~stream_rl.algorithms.policy.policy_loss` weights, aggregates and reports them.
Guarantees: one function per kind (no branching on the kind anywhere else); a kind is registered once and only with
a row in the catalogue (``catalogue.py``); :func:`surrogate_for` of an unknown kind raises ValueError naming the
kind and the registered kinds.

The pattern (a name -> function table filled by a decorator) is the one of verl's ``register_policy_loss``.
Adding a kind: a catalogue row, a function here decorated with ``@register_surrogate("name")`` (formula in the
docstring, shapes in comments), and a test against hand-computed values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from .catalogue import loss_kind
from .spec import LossSpec

MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class SurrogateInputs:
    """What every surrogate reads, each ``[B, T]`` and 0 at masked positions."""

    logp: Tensor  # pi_theta (with gradient)
    log_ratio: Tensor  # clamp(logp - prox_logp, -20, 20), gradient through logp
    advantages: Tensor  # detached
    mask: Tensor  # bool, 1 = response token


class Surrogate(NamedTuple):
    """A surrogate's result, each ``[B, T]``: ``dual_clipped`` is None when the kind has no dual clip or it is off."""

    ratio: Tensor
    pg_loss: Tensor
    clipped: Tensor
    dual_clipped: Tensor | None


class SurrogateFn(Protocol):
    """A loss kind's surrogate: pure, ``(inputs, spec) -> Surrogate``."""

    def __call__(self, x: SurrogateInputs, spec: LossSpec, /) -> Surrogate: ...


SURROGATES: dict[str, SurrogateFn] = {}


def _name(fn: SurrogateFn) -> str:
    return getattr(fn, "__name__", repr(fn))


def register_surrogate(kind: str) -> Callable[[SurrogateFn], SurrogateFn]:
    """Decorator: register ``fn`` as the surrogate of loss kind ``kind``, which must have a catalogue row."""
    loss_kind(kind)  # ValueError for a kind the catalogue does not list

    def add(fn: SurrogateFn) -> SurrogateFn:
        if kind in SURROGATES:
            raise ValueError(f"loss kind {kind!r} is registered twice ({_name(SURROGATES[kind])}, {_name(fn)})")
        SURROGATES[kind] = fn
        return fn

    return add


def surrogate_for(kind: str) -> SurrogateFn:
    """The registered surrogate of ``kind``; ValueError naming the kind and the known kinds otherwise."""
    try:
        return SURROGATES[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown loss kind {kind!r}; known kinds: {', '.join(SURROGATES)}") from None


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


@register_surrogate("ppo")
def ppo_surrogate(x: SurrogateInputs, spec: LossSpec) -> Surrogate:
    """PPO on the per-token ratio r_t = exp(logp_t - prox_logp_t) (:func:`clipped_surrogate`; Schulman et al.
    2017, clip-higher of DAPO, dual clip of Ye et al. 2020)."""
    ratio = x.log_ratio.exp()  # [B, T]
    pg_loss, clipped, dual = clipped_surrogate(ratio, x.advantages, spec.clip_low, spec.clip_high, spec.dual_clip)
    return Surrogate(ratio, pg_loss, clipped, dual if spec.dual_clip is not None else None)


@register_surrogate("gspo")
def gspo_surrogate(x: SurrogateInputs, spec: LossSpec) -> Surrogate:
    """GSPO: one ratio per sequence, clipped like PPO against the sequence's advantage; every valid token carries
    its sequence's loss (Zheng et al. 2025, "Group Sequence Policy Optimization").

    Formula: s_b = exp(clamp(sum_t m_bt log_ratio_bt / n_b, -20, 20)), A_b = the advantage of row b's first valid
    token, seq_loss_b = :func:`clipped_surrogate` (s_b, A_b), spread over the row's tokens.
    """
    m = x.mask
    lengths = m.sum(-1).clamp_min(1).to(x.log_ratio.dtype)  # [B]
    seq_log_ratio = (x.log_ratio.sum(-1) / lengths).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # [B]
    first = m.int().argmax(-1, keepdim=True)  # [B, 1]; index of the first valid token (0 if none)
    seq_ratio, seq_adv = seq_log_ratio.exp(), x.advantages.gather(-1, first).squeeze(-1)  # [B], [B]
    seq_loss, seq_clipped, seq_dual = clipped_surrogate(seq_ratio, seq_adv, spec.clip_low, spec.clip_high,
                                                        spec.dual_clip)
    ratio, pg_loss, clipped, dual = (t[:, None].expand_as(m) for t in (seq_ratio, seq_loss, seq_clipped, seq_dual))
    return Surrogate(ratio, pg_loss, clipped, dual if spec.dual_clip is not None else None)  # [B, T] each


@register_surrogate("cispo")
def cispo_surrogate(x: SurrogateInputs, spec: LossSpec) -> Surrogate:
    """CISPO: REINFORCE on log pi weighted by the clipped, detached per-token ratio (MiniMax et al. 2025,
    "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", section 3.1, eq. 4-5).

    Formula: r_t = exp(logp_t - prox_logp_t), r^_t = clip(r_t, 1 - clip_low, 1 + clip_high),
    pg_loss_t = -sg(r^_t) * A_t * logp_t, so d pg_loss_t / d logp_t = -r^_t * A_t: the clip bounds the weight but,
    unlike PPO's, never takes a token's gradient away. ``clipped`` marks tokens whose weight was clipped. The paper
    sets no lower bound (clip_low = 1: the weight's floor is 0) and tunes only the upper one; its normaliser
    1 / sum_i |o_i| is ``agg="token-mean"``.
    """
    ratio = x.log_ratio.exp()  # [B, T]
    low, high = 1.0 - spec.clip_low, 1.0 + spec.clip_high
    weight = ratio.detach().clamp(low, high)  # [B, T]; sg(r^)
    clipped = (ratio < low) | (ratio > high)  # [B, T]
    return Surrogate(ratio, -weight * x.advantages * x.logp, clipped, None)
