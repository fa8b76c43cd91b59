"""discounted_returns and gae: hand-computed values, the lam = 1 identity, and a naive per-token reference loop."""

from __future__ import annotations

import pytest
import torch

from stream_rl.algorithms import discounted_returns, gae

NAN = float("nan")


def test_discounted_returns_by_hand():
    # Row 0: r = [1, 0, 2 | pad], gamma = 0.5: R2 = 2, R1 = 0 + 0.5 * 2 = 1, R0 = 1 + 0.5 * 1 = 1.5.
    # Row 1: r = [0, 3 | pad, pad]:            R1 = 3, R0 = 0 + 0.5 * 3 = 1.5.
    # Padding holds garbage (100, NaN) that must not leak in; padded outputs are 0.
    rewards = torch.tensor([[1.0, 0.0, 2.0, 100.0], [0.0, 3.0, NAN, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    expected = torch.tensor([[1.5, 1.0, 2.0, 0.0], [1.5, 3.0, 0.0, 0.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), expected)
    # gamma = 1 (the reverse-cumsum path): row 0 -> [3, 2, 2, 0], row 1 -> [3, 3, 0, 0].
    expected = torch.tensor([[3.0, 2.0, 2.0, 0.0], [3.0, 3.0, 0.0, 0.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask.bool(), 1.0), expected)
    # gamma = 0: each token keeps its own reward.
    torch.testing.assert_close(discounted_returns(rewards, mask.float(), 0.0), torch.where(mask.bool(), rewards, 0.0))


def test_gae_by_hand():
    # gamma = 1, lam = 0.5.  Row 0: r = [0, 0, 1 | pad], V = [0.5, 0.25, 0.75 | pad]
    #   delta0 = 0 + 0.25 - 0.5 = -0.25, delta1 = 0 + 0.75 - 0.25 = 0.5, delta2 = 1 + 0 - 0.75 = 0.25 (V = 0 after end)
    #   A2 = 0.25, A1 = 0.5 + 0.5 * 0.25 = 0.625, A0 = -0.25 + 0.5 * 0.625 = 0.0625
    #   returns = A + V = [0.5625, 0.875, 1.0]
    # Row 1: r = [2 | pad...], V = [1.5 | pad...]: delta0 = 2 - 1.5 = 0.5 = A0, returns0 = 2.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0], [2.0, 9.0, 9.0, 9.0]])
    values = torch.tensor([[0.5, 0.25, 0.75, 9.0], [1.5, NAN, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0.0625, 0.625, 0.25, 0.0], [0.5, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.5625, 0.875, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]]))


def random_batch(seed: int, B: int = 5, T: int = 9):
    torch.manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,))
    lengths[0] = T  # one full row
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T], right-padded
    rewards = torch.randn(B, T, dtype=torch.float64)
    values = torch.randn(B, T, dtype=torch.float64)
    return rewards, values, mask


def naive_gae(rewards, values, mask, gamma, lam):
    """Token-by-token reference, written as plainly as possible."""
    advantages = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        length = int(mask[b].sum())
        running = 0.0
        for t in reversed(range(length)):
            next_value = float(values[b, t + 1]) if t + 1 < length else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            advantages[b, t] = running
    return advantages, torch.where(mask, advantages + values, 0.0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.9), (0.5, 0.0), (0.0, 0.7)])
def test_gae_matches_a_naive_loop(gamma, lam):
    rewards, values, mask = random_batch(seed=int(gamma * 100 + lam * 10))
    expected_adv, expected_ret = naive_gae(rewards, values, mask, gamma, lam)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, expected_adv)
    torch.testing.assert_close(returns, expected_ret)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_gae_with_lam_one_is_discounted_returns_minus_values(gamma):
    rewards, values, mask = random_batch(seed=7)
    advantages, returns = gae(rewards, values, mask, gamma, lam=1.0)
    expected = torch.where(mask, discounted_returns(rewards, mask, gamma) - values, 0.0)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, discounted_returns(rewards, mask, gamma))


def test_masked_positions_change_nothing():
    rewards, values, mask = random_batch(seed=11)
    noisy_rewards = torch.where(mask, rewards, torch.full_like(rewards, 1e6))
    noisy_values = torch.where(mask, values, torch.full_like(values, NAN))
    clean = gae(torch.where(mask, rewards, 0.0), torch.where(mask, values, 0.0), mask, 0.9, 0.8)
    noisy = gae(noisy_rewards, noisy_values, mask, 0.9, 0.8)
    for a, b in zip(clean, noisy):
        torch.testing.assert_close(a, b)
        assert bool((a[~mask] == 0).all())


def test_bad_arguments_raise_value_errors():
    rewards = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns(rewards, mask, 1.5)
    with pytest.raises(ValueError, match="gamma"):
        gae(rewards, rewards, mask, -0.1, 0.9)
    with pytest.raises(ValueError, match="lam"):
        gae(rewards, rewards, mask, 1.0, 2.0)
    with pytest.raises(ValueError, match="values"):
        gae(rewards, torch.zeros(2, 4), mask, 1.0, 1.0)
    with pytest.raises(ValueError, match="mask"):
        discounted_returns(rewards, torch.ones(2, 4), 1.0)
    with pytest.raises(ValueError, match="right-padded"):
        discounted_returns(rewards, torch.tensor([[1, 0, 1], [1, 1, 0]]), 1.0)
    with pytest.raises(ValueError, match="0 or 1"):
        discounted_returns(rewards, torch.full((2, 3), 0.5), 1.0)
    with pytest.raises(ValueError, match="token_rewards"):
        discounted_returns(torch.zeros(6), torch.ones(6), 1.0)
