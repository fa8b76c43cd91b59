"""DAPO's reward shaping and sample filters: the soft overlong penalty, overlong filtering, zero-variance groups.

Consumes: response lengths ``[B]`` (int), finish flags ``[B]`` (bool), sequence rewards ``[B]`` with dense group
ids ``[B]``.
Produces: a penalty ``[B]`` to add to the sequence reward, a keep mask ``[B]`` for the loss, a per-group flag ``[B]``.
Guarantees: pure (no state, no I/O); bad arguments raise ``ValueError`` naming the argument.

Reference: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv:2503.14476):
section 3.2 (dynamic sampling: groups whose accuracy is all 0 or all 1 give GRPO advantages of exactly 0 and are
filtered out, and sampling continues until the batch is full) and section 3.4 (overlong filtering masks the loss
of truncated samples; soft overlong punishment, their equation 13).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_float, check_same_shape, check_tensor


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """Soft overlong punishment of each response, ``[B]`` float32, to be added to its reward.

    Formula (DAPO eq. 13, with L_max = ``max_len``, L_cache = ``buffer``, scaled by ``factor``)::

        R_length(y) =  0                                    |y| <= L_max - L_cache
                       ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                      -1                                    L_max < |y|

    so the penalty falls linearly from 0 to -``factor`` over the last ``buffer`` tokens of the budget.
    """
    lengths = check_tensor(lengths, "lengths", ndim=1)
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if not 1 <= buffer <= max_len:
        raise ValueError(f"buffer must be in [1, max_len={max_len}], got {buffer}")
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    n = lengths.to(torch.float32)  # [B]
    start = float(max_len - buffer)
    ramp = (start - n) / float(buffer)  # [B] in [-1, 0) inside the buffer
    penalty = torch.where(n <= start, torch.zeros_like(n), torch.where(n <= max_len, ramp, -torch.ones_like(n)))
    return factor * penalty  # [B]


def overlong_keep(truncated: Tensor) -> Tensor:
    """Overlong filtering: keep ``[B]`` bool, False for a response cut at the length budget.

    Formula: keep_b = not truncated_b; use it as ``mask & keep[:, None]`` for the loss only (the group's advantage
    statistics still see the truncated sample's reward, as in DAPO)."""
    truncated = check_tensor(truncated, "truncated", ndim=1)
    return ~truncated.bool()  # [B]


def zero_variance_groups(rewards: Tensor, group_ids: Tensor, atol: float = 0.0) -> Tensor:
    """Per sample, whether its group's rewards are all equal (within ``atol``): ``[B]`` bool.

    Formula: uniform_b = max_{j in g(b)} r_j - min_{j in g(b)} r_j <= atol. Such a group's GRPO/RLOO advantages
    are all exactly 0 (r_b - mean = 0), so it carries no policy gradient (DAPO section 3.2)."""
    rewards = check_float(rewards, "rewards", ndim=1)
    group_ids = check_tensor(group_ids, "group_ids", ndim=1)
    check_same_shape(rewards, "rewards", group_ids=group_ids)
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    _, dense = torch.unique(group_ids, return_inverse=True)  # [B] in [0, G)
    groups = int(dense.max()) + 1 if dense.numel() else 0
    hi = torch.full((groups,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, dense, rewards, "amax")  # [G]
    lo = torch.full((groups,), torch.inf, dtype=rewards.dtype).scatter_reduce(0, dense, rewards, "amin")  # [G]
    return (hi - lo <= atol)[dense]  # [B]
