"""Masked reductions and the loss aggregation modes shared by the policy and value losses.

Consumes: a per-token quantity ``x`` ``[B, T]`` and a response mask ``[B, T]`` (bool or 0/1).
Produces: a 0-dim tensor.
Guarantees: positions where ``mask`` is 0 never contribute to the value or the gradient, whatever they hold
(NaN and inf included: they are replaced by 0 with ``torch.where`` before any arithmetic). An empty mask gives 0.

The three aggregation modes (``agg``), with m the mask, L the per-token loss, n_b = sum_t m_bt the length of
sequence b, T the padded width and S the set of sequences with n_b > 0:

- ``"token-mean"``:              sum_bt m L / sum_bt m                       (every token weighs the same; DAPO)
- ``"seq-mean-token-mean"``:     1/|S| sum_{b in S} (sum_t m L / n_b)        (every sequence weighs the same; GRPO)
- ``"seq-mean-token-sum-norm"``: 1/|S| sum_{b in S} (sum_t m L / T)          (constant length normaliser; Dr. GRPO)

With equal lengths n_b = n the first two agree; the third equals them times n / T (equal when there is no padding).
Fully-masked sequences are left out of |S| so that a dropped sequence (e.g. by the staleness filter) does not dilute
the loss. References: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO);
Yu et al. 2025, "DAPO" (token-level loss); verl's ``agg_loss`` modes of the same names.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_choice, check_float

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) over ``dim`` (all dims when None); masked entries are replaced by 0 first."""
    x = check_float(x, "x")
    m = as_bool_mask(mask, x, "x")
    x = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(x * mask) / sum(mask) over ``dim`` (all dims when None); 0 where the mask holds no valid entry."""
    x = check_float(x, "x")
    m = as_bool_mask(mask, x, "x")
    total = masked_sum(x, m, dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp_min(1).to(x.dtype)


def aggregate(per_token: Tensor, mask: Tensor, agg: str = "token-mean") -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar with one of :data:`AGG_MODES` (formulas in the module doc)."""
    per_token = check_float(per_token, "per_token", ndim=2)
    check_choice(agg, "agg", AGG_MODES)
    m = as_bool_mask(mask, per_token, "per_token")
    if agg == "token-mean":
        return masked_mean(per_token, m)
    seq_sum = masked_sum(per_token, m, dim=-1)  # [B]
    lengths = m.sum(-1)  # [B]
    if agg == "seq-mean-token-mean":
        seq_loss = seq_sum / lengths.clamp_min(1).to(per_token.dtype)  # [B]
    else:  # "seq-mean-token-sum-norm"
        seq_loss = seq_sum / per_token.shape[-1]  # [B]
    n_seqs = (lengths > 0).sum().clamp_min(1).to(per_token.dtype)
    return seq_loss.sum() / n_seqs
