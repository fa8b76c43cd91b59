"""Masked reductions, the loss aggregation modes shared by the policy, KL and value losses, and their normaliser.

Consumes: a per-token quantity ``x`` ``[B, T]`` and a response mask ``[B, T]`` (bool or 0/1).
Produces: a 0-dim tensor.
Guarantees: positions where ``mask`` is 0 never contribute to the value or the gradient, whatever they hold
(NaN and inf included: they are replaced by 0 with ``torch.where`` before any arithmetic). An empty mask gives 0.

The three aggregation modes (``agg``), with m the mask, L the per-token loss, n_b = sum_t m_bt the length of
sequence b, S the set of sequences with n_b > 0 and L_max the generation budget (``max_len``):

- ``"token-mean"``:              sum_bt m L / sum_bt m                        (every token weighs the same; DAPO)
- ``"seq-mean-token-mean"``:     1/|S| sum_{b in S} (sum_t m L / n_b)         (every sequence weighs the same; GRPO)
- ``"seq-mean-token-sum-norm"``: 1/|S| sum_{b in S} (sum_t m L / L_max)       (constant length normaliser; Dr. GRPO)

Each mode is a numerator divided by a normaliser that depends only on the mask (:func:`loss_normaliser`):
sum_bt m, |S| and |S| * L_max. Splitting a batch into micro batches, computing each micro batch's numerator and
dividing every one of them by the normaliser of the *whole* batch gives exactly the whole batch's loss and gradient
(``aggregate(..., normaliser=...)``); a trainer with several data-parallel ranks all-reduces that normaliser.

Dr. GRPO's L_max is a constant of the run (the generation budget), never the padded width of a batch: dividing by
the batch's longest response would make one sequence's gradient depend on the other sequences of its batch. A
response longer than L_max is an error (it would weigh more than the budget allows). Fully-masked sequences are left
out of |S| so that a dropped sequence (e.g. by the staleness filter) does not dilute the loss.
References: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO);
Yu et al. 2025, "DAPO" (token-level loss); verl's ``agg_loss`` modes of the same names.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_choice, check_float, check_tensor
from .catalogue import AGG_MODES


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


def _check_max_len(m: Tensor, agg: str, max_len: int | None) -> None:
    """Dr. GRPO needs the generation budget, and no response may be longer than it."""
    if agg != "seq-mean-token-sum-norm":
        return
    if max_len is None:
        raise ValueError("agg='seq-mean-token-sum-norm' needs max_len, the generation budget (a constant "
                         "normaliser); the padded width of a batch is not one")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
    longest = int(m.sum(-1).max()) if m.numel() else 0
    if longest > max_len:
        raise ValueError(f"a response of {longest} tokens is longer than max_len={max_len}")


def loss_normaliser(mask: Tensor, agg: str = "token-mean", *, max_len: int | None = None) -> Tensor:
    """What ``agg`` divides its numerator by over ``mask`` ``[B, T]``: a 0-dim float64 tensor, at least 1.

    Formula: token-mean: sum_bt m; seq-mean-token-mean: |S|; seq-mean-token-sum-norm: |S| * max_len, with S the
    sequences that hold a valid token (module docstring). Reference: as :func:`aggregate`. ``max_len`` is required by
    (and only used by) ``seq-mean-token-sum-norm``; a response longer than it raises ValueError.
    """
    check_choice(agg, "agg", AGG_MODES)
    m = as_bool_mask(check_tensor(mask, "mask", ndim=2), mask, "mask")
    _check_max_len(m, agg, max_len)
    count = m.sum() if agg == "token-mean" else m.any(-1).sum()  # tokens, or non-empty sequences
    count = count.clamp_min(1).to(torch.float64)
    return count * max_len if agg == "seq-mean-token-sum-norm" and max_len is not None else count


def aggregate(per_token: Tensor, mask: Tensor, agg: str = "token-mean", *, max_len: int | None = None,
              normaliser: Tensor | float | None = None) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar with one of :data:`AGG_MODES` (formulas in the module doc).

    Formula: numerator / normaliser, with numerator = sum_bt m L (token-mean, seq-mean-token-sum-norm) or
    sum_b sum_t m L / n_b (seq-mean-token-mean), and normaliser = :func:`loss_normaliser` of ``mask`` unless given.
    Pass the ``normaliser`` of a whole batch to a micro batch of it: the micro losses then sum to the batch's loss.
    ``max_len``: the generation budget, required by ``seq-mean-token-sum-norm``.
    """
    per_token = check_float(per_token, "per_token", ndim=2)
    check_choice(agg, "agg", AGG_MODES)
    m = as_bool_mask(mask, per_token, "per_token")
    if normaliser is None:
        normaliser = loss_normaliser(m, agg, max_len=max_len)
    else:
        _check_max_len(m, agg, max_len)
        if not float(normaliser) > 0:
            raise ValueError(f"normaliser must be > 0, got {float(normaliser)}")
    if agg == "seq-mean-token-mean":
        seq_sum = masked_sum(per_token, m, dim=-1)  # [B]
        numerator = (seq_sum / m.sum(-1).clamp_min(1).to(per_token.dtype)).sum()
    else:
        numerator = masked_sum(per_token, m)
    if isinstance(normaliser, Tensor):
        normaliser = normaliser.to(device=per_token.device, dtype=per_token.dtype)
    return numerator / normaliser
