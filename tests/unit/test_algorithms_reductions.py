"""aggregate / loss_normaliser: Dr. GRPO's constant normaliser, and micro batches over one batch normaliser."""

from __future__ import annotations

import pytest
import torch

from stream_rl.algorithms import AGG_MODES, LossSpec, aggregate, loss_normaliser, policy_loss


def rows(lengths, width, seed=0):
    """Per-token values [B, width] with right-padded masks of the given lengths (padding holds garbage)."""
    torch.manual_seed(seed)
    x = torch.randn(len(lengths), width, dtype=torch.float64)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return torch.where(mask, x, torch.full_like(x, 1e6)), mask


def test_normaliser_by_hand():
    # lengths 3, 1, 0 (an empty row), width 4: tokens 4; non-empty sequences 2; Dr. GRPO 2 * budget 5 = 10
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert loss_normaliser(mask, "token-mean").item() == 4
    assert loss_normaliser(mask, "seq-mean-token-mean").item() == 2
    assert loss_normaliser(mask, "seq-mean-token-sum-norm", max_len=5).item() == 10
    assert loss_normaliser(torch.zeros(2, 3, dtype=torch.bool), "token-mean").item() == 1  # never 0


def test_dr_grpo_needs_the_budget_and_refuses_longer_responses():
    x, mask = rows([3, 5], 5)
    with pytest.raises(ValueError, match="max_len"):
        aggregate(x, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="longer than max_len=4"):
        aggregate(x, mask, "seq-mean-token-sum-norm", max_len=4)
    with pytest.raises(ValueError, match="max_len"):
        loss_normaliser(mask, "seq-mean-token-sum-norm", max_len=0)
    # the other modes do not use it
    assert aggregate(x, mask, "token-mean", max_len=1).item() == pytest.approx(aggregate(x, mask).item())


def test_dr_grpo_loss_and_gradient_do_not_depend_on_the_other_sequences_lengths():
    """The same two sequences (lengths 3 and 5) in a batch whose third sequence is 2 tokens long (padded width 6)
    or 12 tokens long (padded width 12): with the budget max_len = 12 their loss terms and gradients are identical.
    Hand value: loss = (sum of row 0 + sum of row 1 + sum of row 2) / (3 sequences * 12)."""
    fixed, fixed_mask = rows([3, 5], 6, seed=1)
    grads = []
    for other_len, width in ((2, 6), (12, 12)):
        other, other_mask = rows([other_len], width, seed=2)
        x = torch.cat([torch.nn.functional.pad(fixed, (0, width - 6)), other]).requires_grad_(True)
        mask = torch.cat([torch.nn.functional.pad(fixed_mask, (0, width - 6)), other_mask])
        loss = aggregate(x, mask, "seq-mean-token-sum-norm", max_len=12)
        expected = float(torch.where(mask, x.detach(), 0).sum()) / (3 * 12)
        assert loss.item() == pytest.approx(expected, abs=1e-12)
        loss.backward()
        grads.append(x.grad[:2, :6])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert torch.equal(grads[0], fixed_mask.double() / 36)  # d loss / d x = 1 / (|S| * max_len) on valid tokens
    # (dividing by the padded width instead, the old behaviour, gives 1 / (3 * 6) in the first batch and
    # 1 / (3 * 12) in the second: a sequence's gradient would depend on its batch-mates)


def test_dr_grpo_through_policy_loss_is_invariant_to_padding_width():
    logp, mask = rows([3, 5], 6, seed=3)
    adv = torch.randn(2, 6, dtype=torch.float64)
    grads = []
    for width in (6, 12):
        pad = (0, width - 6)
        x = torch.nn.functional.pad(logp, pad).requires_grad_(True)
        loss, _ = policy_loss(x, x.detach(), torch.nn.functional.pad(adv, pad), torch.nn.functional.pad(mask, pad),
                              LossSpec(agg="seq-mean-token-sum-norm", max_len=12))
        loss.backward()
        grads.append(x.grad[:, :6])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_over_the_batch_normaliser_sum_to_the_batch_loss(agg):
    x, mask = rows([4, 1, 6, 3, 2], 6, seed=4)
    budget = {"max_len": 6}
    whole = aggregate(x, mask, agg, **budget)
    total = loss_normaliser(mask, agg, **budget)
    parts = [aggregate(x[idx], mask[idx], agg, normaliser=total, **budget)
             for idx in (torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([3, 4]))]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), abs=1e-12)
    with pytest.raises(ValueError, match="normaliser"):
        aggregate(x, mask, agg, normaliser=0.0, **budget)
