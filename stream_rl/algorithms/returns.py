"""Discounted returns and generalised advantage estimation (GAE) over right-padded token sequences.

Consumes: per-token rewards ``[B, T]`` (typically 0 everywhere but the last valid token, which holds the sequence
reward, possibly minus a per-token KL penalty), values ``[B, T]`` from a critic, and a right-padded mask ``[B, T]``.
Produces: ``[B, T]`` tensors, 0 at masked positions.
Guarantees: what masked positions hold never matters (they are replaced by 0 first); the episode ends after the last
valid token of each row, so nothing is bootstrapped from padding.

Both recursions are the reverse discounted cumulative sum y_t = x_t + c * y_{t+1} (y = 0 past the last valid token).
For c = 1 (the usual LLM setting, gamma = lam = 1) it is one reverse ``cumsum``; otherwise a loop over T of
vectorised ``[B]`` steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_float, check_same_shape, check_unit_interval


def _reverse_discounted_cumsum(x: Tensor, mask: Tensor, discount: float) -> Tensor:
    """y_t = x_t + discount * y_{t+1} on valid tokens, y = 0 elsewhere; ``mask`` is a right-padded bool ``[B, T]``."""
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))  # [B, T]
    if discount == 1.0 or x.shape[-1] == 0:
        return x.flip(-1).cumsum(-1).flip(-1)  # [B, T]; padding is 0, so sums past the end add nothing
    steps = []
    running = torch.zeros_like(x[:, 0])  # [B]
    for t in range(x.shape[-1] - 1, -1, -1):
        running = x[:, t] + discount * running  # [B]
        steps.append(running)
    return torch.stack(steps[::-1], dim=-1)  # [B, T]


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go of every valid token.

    Formula: R_t = sum_{k >= t, k valid} gamma^(k - t) r_k, i.e. R_t = r_t + gamma * R_{t+1}, R = 0 after the last
    valid token. Reference: Sutton & Barto, "Reinforcement Learning: An Introduction", 2nd ed., eq. 3.8.

    ``token_rewards`` ``[B, T]``, ``mask`` ``[B, T]`` right-padded, ``gamma`` in [0, 1]. Returns ``[B, T]``.
    """
    token_rewards = check_float(token_rewards, "token_rewards", ndim=2)
    m = as_bool_mask(mask, token_rewards, "token_rewards", prefix=True)
    gamma = check_unit_interval(gamma, "gamma")
    return _reverse_discounted_cumsum(token_rewards, m, gamma)  # [B, T]


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; returns ``(advantages, returns)``, both ``[B, T]``.

    Formula: delta_t = r_t + gamma * V_{t+1} - V_t, with V_{t+1} = 0 after the last valid token;
    A_t = delta_t + gamma * lam * A_{t+1} (A = 0 after the last valid token); returns_t = A_t + V_t on valid tokens.
    Reference: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
    eq. 16; the PPO-RLHF setting of Ouyang et al. 2022 (InstructGPT).

    With lam = 1, A_t = R_t - V_t (discounted return minus value); with lam = 0, A_t = delta_t.
    ``values`` is treated as given (callers pass detached critic outputs); ``gamma`` and ``lam`` in [0, 1].
    """
    token_rewards = check_float(token_rewards, "token_rewards", ndim=2)
    check_same_shape(token_rewards, "token_rewards", values=values)
    values = check_float(values, "values")
    m = as_bool_mask(mask, token_rewards, "token_rewards", prefix=True)
    gamma = check_unit_interval(gamma, "gamma")
    lam = check_unit_interval(lam, "lam")
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(m, values, zero)  # [B, T]
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))  # [B, T]; V_{t+1}, 0 past the last valid token
    deltas = token_rewards + gamma * next_values - values  # [B, T]
    advantages = _reverse_discounted_cumsum(deltas, m, gamma * lam)  # [B, T]
    returns = torch.where(m, advantages + values, zero)  # [B, T]
    return advantages, returns
