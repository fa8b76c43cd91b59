"""GRPO, Dr. GRPO, RLOO and REINFORCE++ advantages on hand-computed cases, plus their invariants."""

from __future__ import annotations

import math

import pytest
import torch

from stream_rl.algorithms import (
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_tokens,
    whiten_advantages,
)

# Three groups, interleaved and with arbitrary ids: group 7 = rewards [1, 0, 0, 1], group -1 = [2, 4],
# groups 3 and 9 are singletons.
REWARDS = torch.tensor([1.0, 2.0, 0.0, 0.5, 0.0, 4.0, 1.0, 3.0])
GROUPS = torch.tensor([7, -1, 7, 3, 7, -1, 7, 9])


def test_grpo_by_hand():
    # Group 7: mean 0.5, centred [0.5, -0.5, -0.5, 0.5], Bessel var = 1 / 3, std = 1 / sqrt(3),
    #          A = +-0.5 * sqrt(3) = +-0.866025.
    # Group -1: mean 3, centred [-1, 1], var = 2 / 1, std = sqrt(2), A = -+1 / sqrt(2) = -+0.707107.
    # Singletons: 0.
    h, s = 0.5 * math.sqrt(3.0), 1.0 / math.sqrt(2.0)
    expected = torch.tensor([h, -s, -h, 0.0, -h, s, h, 0.0])
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUPS, eps=0.0), expected)
    # The default eps = 1e-6 sits next to the std: A = centred / (std + 1e-6).
    expected_eps = torch.tensor([0.5 / (1 / math.sqrt(3) + 1e-6), -1 / (math.sqrt(2) + 1e-6)])
    out = grpo_advantages(REWARDS, GROUPS)
    torch.testing.assert_close(out[[0, 1]], expected_eps)


def test_dr_grpo_by_hand():
    # Without the std: A = r - group mean.
    expected = torch.tensor([0.5, -1.0, -0.5, 0.0, -0.5, 1.0, 0.5, 0.0])
    torch.testing.assert_close(grpo_advantages(REWARDS, GROUPS, scale_by_std=False), expected)


def test_rloo_by_hand():
    # Group 7: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3, A_2 = 0 - (1 + 0 + 1) / 3 = -2/3.
    # Group -1: A = 2 - 4 = -2 and 4 - 2 = 2. Singletons: 0.
    expected = torch.tensor([2 / 3, -2.0, -2 / 3, 0.0, -2 / 3, 2.0, 2 / 3, 0.0])
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUPS), expected)
    # Group ids given as a plain list work too.
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUPS.tolist()), expected)


@pytest.mark.parametrize("estimator", [
    lambda r, g: grpo_advantages(r, g),
    lambda r, g: grpo_advantages(r, g, scale_by_std=False),
    rloo_advantages,
])
def test_group_advantages_sum_to_zero_and_singletons_are_zero(estimator):
    torch.manual_seed(0)
    rewards = torch.randn(40, dtype=torch.float64)
    groups = torch.randint(0, 12, (40,))
    groups[-3:] = torch.tensor([100, 101, 102])  # guaranteed singletons
    advantages = estimator(rewards, groups)
    for g in groups.unique():
        members = groups == g
        if int(members.sum()) == 1:
            assert float(advantages[members]) == 0.0
        else:
            assert abs(float(advantages[members].sum())) < 1e-12
    # A group whose rewards are all equal gets 0 everywhere (no NaN from a zero std).
    flat = estimator(torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    assert bool((flat == 0).all())


def test_rloo_is_a_rescaled_dr_grpo():
    # A_rloo = n / (n - 1) * (r - mean): with n = 4, 4/3 times the Dr. GRPO advantage.
    torch.manual_seed(1)
    rewards = torch.randn(12, dtype=torch.float64)
    groups = torch.arange(12) // 4
    expected = 4 / 3 * grpo_advantages(rewards, groups, scale_by_std=False)
    torch.testing.assert_close(rloo_advantages(rewards, groups), expected)


def test_reinforce_pp_by_hand():
    # gamma = 0.5. Row 0: r = [0, 0, 1] -> R = [0.25, 0.5, 1]. Row 1: r = [0, 2 | pad] -> R = [1, 2 | 0].
    # Valid R = [0.25, 0.5, 1, 1, 2]: mean 0.95, deviations [-0.7, -0.45, 0.05, 0.05, 1.05],
    # sum of squares 1.8, unbiased var = 1.8 / 4 = 0.45; A = deviation / sqrt(0.45 + 1e-8).
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    scale = 1 / math.sqrt(0.45 + 1e-8)
    expected = torch.tensor([[-0.7, -0.45, 0.05], [0.05, 1.05, 0.0]]) * scale
    out = reinforce_pp_advantages(rewards, mask, 0.5)
    torch.testing.assert_close(out, expected)
    assert abs(float(out.sum())) < 1e-5  # whitened: zero mean over valid tokens


def test_reinforce_pp_edge_cases():
    # One valid token: R - mean = 0, so A = 0 (no division by N - 1 = 0). No valid tokens: all 0.
    out = reinforce_pp_advantages(torch.tensor([[3.0, 1.0]]), torch.tensor([[1, 0]]), 1.0)
    torch.testing.assert_close(out, torch.zeros(1, 2))
    out = reinforce_pp_advantages(torch.tensor([[3.0, 1.0]]), torch.tensor([[0, 0]]), 1.0)
    torch.testing.assert_close(out, torch.zeros(1, 2))


def test_whiten_advantages_by_hand():
    # Valid A = [1, 3 | 5, 7, pad]: mean 4, deviations [-3, -1, 1, 3], sum of squares 20, unbiased var 20 / 3;
    # A' = deviation / sqrt(20 / 3 + 1e-8). Padding (99) is ignored and comes out 0.
    adv = torch.tensor([[1.0, 3.0, 99.0], [5.0, 7.0, 99.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    scale = 1 / math.sqrt(20 / 3 + 1e-8)
    expected = torch.tensor([[-3.0, -1.0, 0.0], [1.0, 3.0, 0.0]]) * scale
    out = whiten_advantages(adv, mask)
    torch.testing.assert_close(out, expected)
    valid = out[mask.bool()]
    assert abs(float(valid.mean())) < 1e-6 and float(valid.std()) == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(whiten_advantages(torch.tensor([[2.0, 0.0]]), torch.tensor([[1, 0]])),
                               torch.zeros(1, 2))  # one valid token: nothing to whiten against


def test_sequence_to_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    out = sequence_to_tokens(torch.tensor([2.0, 5.0, -1.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [-1.0, -1.0, -1.0]]))


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="group_ids"):
        rloo_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), eps=-1.0)
    with pytest.raises(ValueError, match="gamma"):
        reinforce_pp_advantages(torch.zeros(2, 3), torch.ones(2, 3), 1.01)
    with pytest.raises(ValueError, match="mask"):
        sequence_to_tokens(torch.zeros(3), torch.ones(2, 3))
