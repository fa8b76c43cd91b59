"""Critic-free advantage estimators: GRPO, Dr. GRPO, RLOO (per sequence), REINFORCE++ (per token), and whitening.

Consumes: one scalar reward per sequence ``[B]`` plus a group id per sequence ``[B]`` (sequences sampled from the same
prompt share an id; ids are any integers, in any order), or per-token rewards ``[B, T]`` with a right-padded mask.
Produces: ``[B]`` advantages (GRPO, RLOO), to be spread over the response with :func:`sequence_to_tokens`, or
``[B, T]`` advantages (REINFORCE++), 0 at masked positions.
Guarantees: group advantages sum to 0 within every group (up to rounding); a group of one sequence gets 0, since it
has no baseline to compare with.

How this differs from the papers: GRPO (Shao et al. 2024) normalises with the group's standard deviation; we use the
Bessel-corrected sample std, as TRL does, and add ``eps`` to it (not inside the square root). Dr. GRPO is GRPO with
``scale_by_std=False``. Nothing here adds a KL term: put a KL penalty into the token rewards before REINFORCE++, or
into the loss for GRPO.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_float, check_tensor
from .returns import discounted_returns


def _group_index(group_ids: Tensor | Sequence[int], rewards: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids ``[B]`` to dense indices in [0, G); return (index [B], G)."""
    if not isinstance(group_ids, Tensor):
        group_ids = torch.as_tensor(group_ids, device=rewards.device)
    check_tensor(group_ids, "group_ids", ndim=1)
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must have the shape of rewards {tuple(rewards.shape)}, got {tuple(group_ids.shape)}")
    unique, index = torch.unique(group_ids.to(rewards.device), return_inverse=True)
    return index, unique.numel()


def _group_sum(x: Tensor, index: Tensor, n_groups: int) -> Tensor:
    """Sum of ``x`` ``[B]`` within each group -> ``[G]``."""
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add(0, index, x)


def grpo_advantages(rewards: Tensor, group_ids: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantage of each sequence.

    Formula: A_i = (r_i - mean_g) / (std_g + eps) when ``scale_by_std`` (GRPO), A_i = r_i - mean_g otherwise
    (Dr. GRPO), where g is i's group, mean_g its mean reward and std_g = sqrt(sum_{j in g} (r_j - mean_g)^2 / (n_g - 1))
    its Bessel-corrected sample standard deviation. A_i = 0 when n_g = 1.
    References: Shao et al. 2024, "DeepSeekMath" (GRPO, eq. for outcome supervision); Liu et al. 2025,
    "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO drops the std).

    ``rewards`` ``[B]`` float, ``group_ids`` ``[B]`` integer, ``eps`` >= 0. Returns ``[B]``.
    """
    rewards = check_float(rewards, "rewards", ndim=1)
    if float(eps) < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    index, n_groups = _group_index(group_ids, rewards)
    count = _group_sum(torch.ones_like(rewards), index, n_groups)  # [G]
    mean = _group_sum(rewards, index, n_groups) / count.clamp_min(1)  # [G]
    centered = rewards - mean[index]  # [B]
    advantages = centered
    if scale_by_std:
        var = _group_sum(centered.square(), index, n_groups) / (count - 1).clamp_min(1)  # [G]
        advantages = centered / (var.sqrt()[index] + eps)  # [B]
    return torch.where(count[index] > 1, advantages, torch.zeros_like(advantages))  # [B]


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out advantage of each sequence.

    Formula: A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1) = n_g / (n_g - 1) * (r_i - mean_g); A_i = 0 when
    n_g = 1. References: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
    "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs".

    ``rewards`` ``[B]`` float, ``group_ids`` ``[B]`` integer. Returns ``[B]``.
    """
    rewards = check_float(rewards, "rewards", ndim=1)
    index, n_groups = _group_index(group_ids, rewards)
    count = _group_sum(torch.ones_like(rewards), index, n_groups)[index]  # [B]
    total = _group_sum(rewards, index, n_groups)[index]  # [B]
    baseline = (total - rewards) / (count - 1).clamp_min(1)  # [B]; mean of the other members
    return torch.where(count > 1, rewards - baseline, torch.zeros_like(rewards))  # [B]


def whiten_advantages(advantages: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Advantages whitened over every valid token of the batch: zero mean, unit variance.

    Formula: with N valid tokens, mu = sum(A) / N and var = sum((A - mu)^2) / (N - 1) over valid tokens,
    A'_t = (A_t - mu) * rsqrt(var + eps); A' = 0 at masked positions and when N <= 1.
    Reference: the advantage normalisation of PPO implementations (OpenAI baselines ppo2, CleanRL's
    ``norm_adv``; Ouyang et al. 2022's RLHF PPO); REINFORCE++ (Hu 2025) applies it to its returns.

    ``advantages`` ``[B, T]``, ``mask`` ``[B, T]``, ``eps`` >= 0. Apply it to the whole batch, not micro batch by micro
    batch, so every update sees the same advantages. Returns ``[B, T]``.
    """
    advantages = check_float(advantages, "advantages", ndim=2)
    m = as_bool_mask(mask, advantages, "advantages")
    if float(eps) < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    x = torch.where(m, advantages, zero)  # [B, T]
    n = m.sum().to(x.dtype)
    mean = x.sum() / n.clamp_min(1)
    centered = torch.where(m, x - mean, zero)  # [B, T]
    var = centered.square().sum() / (n - 1).clamp_min(1)
    return torch.where(m, centered * torch.rsqrt(var + eps), zero)  # [B, T]


def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++ advantages: discounted returns whitened over every valid token of the batch.

    Formula: A = whiten_advantages(discounted_returns(token_rewards, mask, gamma), mask), i.e. with N valid tokens,
    mu = sum(R) / N and var = sum((R - mu)^2) / (N - 1) over valid tokens, A_t = (R_t - mu) * rsqrt(var + 1e-8).
    A = 0 when N <= 1. Reference: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models" (the global-batch normalisation of OpenRLHF's ``reinforce_plus_plus`` estimator).

    ``token_rewards`` ``[B, T]`` (per-token KL penalty already folded in, if any), ``mask`` ``[B, T]`` right-padded,
    ``gamma`` in [0, 1]. Returns ``[B, T]``.
    """
    returns = discounted_returns(token_rewards, mask, gamma)  # [B, T]; validates the arguments
    return whiten_advantages(returns, mask)  # [B, T]


def sequence_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """Spread one value per sequence ``[B]`` over that sequence's valid tokens: out[b, t] = seq_values[b] * mask[b, t].

    Use it to turn :func:`grpo_advantages` / :func:`rloo_advantages` into the ``[B, T]`` advantages of
    :func:`~stream_rl.algorithms.policy.policy_loss`. Returns ``[B, T]``, 0 at masked positions.
    """
    seq_values = check_float(seq_values, "seq_values", ndim=1)
    mask = check_tensor(mask, "mask", ndim=2)
    if mask.shape[0] != seq_values.shape[0]:
        raise ValueError(f"mask must have {seq_values.shape[0]} rows (one per seq_values entry), got {mask.shape[0]}")
    expanded = seq_values.unsqueeze(-1).expand(mask.shape)  # [B, T]
    m = as_bool_mask(mask, expanded, "seq_values expanded over mask")
    return torch.where(m, expanded, torch.zeros((), dtype=seq_values.dtype, device=seq_values.device))  # [B, T]
