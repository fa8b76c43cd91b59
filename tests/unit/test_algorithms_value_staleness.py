"""value_loss (clipped critic loss) and the staleness helpers policy_lag / max_lag_filter."""

from __future__ import annotations

import pytest
import torch

from stream_rl.algorithms import max_lag_filter, policy_lag, value_loss


def test_value_loss_by_hand():
    # clip 0.2; V = [1, 0, 2], old_V = [0.5, 0.5, 1], R = [2, 1, 1] (a padded 4th token holds garbage):
    #   t0: (1 - 2)^2 = 1; V_clipped = 0.5 + clip(0.5) = 0.7, (0.7 - 2)^2 = 1.69 -> 1.69 (clipped, no gradient)
    #   t1: (0 - 1)^2 = 1; V_clipped = 0.5 - 0.2 = 0.3, (0.3 - 1)^2 = 0.49 -> 1
    #   t2: (2 - 1)^2 = 1; V_clipped = 1 + 0.2 = 1.2, (1.2 - 1)^2 = 0.04 -> 1
    # loss = 0.5 * (1.69 + 1 + 1) / 3 = 0.615; vf_clipfrac = 1/3; gradient (V - R) / 3 off the clip = [0, -1/3, 1/3].
    # Explained variance: Var(R) = 2/9, Var(R - V) = Var([1, 1, -1]) = 8/9, so 1 - (8/9) / (2/9) = -3.
    values = torch.tensor([[1.0, 0.0, 2.0, 50.0]], requires_grad=True)
    old_values = torch.tensor([[0.5, 0.5, 1.0, float("nan")]])
    returns = torch.tensor([[2.0, 1.0, 1.0, -50.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, metrics = value_loss(values, old_values, returns, mask)
    assert loss.item() == pytest.approx(0.615, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -1 / 3, 1 / 3, 0.0]]))
    assert metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["values_mean"].item() == pytest.approx(1.0)
    assert metrics["returns_mean"].item() == pytest.approx(4 / 3)
    assert metrics["vf_explained_var"].item() == pytest.approx(-3.0, abs=1e-5)
    # Without clipping: 0.5 * (1 + 1 + 1) / 3 = 0.5.
    loss, metrics = value_loss(values, old_values, returns, mask, clip=None)
    assert loss.item() == pytest.approx(0.5) and metrics["vf_clipfrac"].item() == 0.0


def test_value_loss_agg_modes_and_perfect_critic():
    # Rows of lengths 2 and 1, T = 2, per-token losses 0.5 * [1, 4 | 9]: token-mean = (0.5 + 2 + 4.5) / 3 = 7/3;
    # seq-mean-token-mean = (1.25 + 4.5) / 2 = 2.875; seq-mean-token-sum-norm (budget 2) = (2.5/2 + 4.5/2) / 2 = 1.75.
    values = torch.zeros(2, 2)
    returns = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    expected = {"token-mean": 7 / 3, "seq-mean-token-mean": 2.875, "seq-mean-token-sum-norm": 1.75}
    for agg, value in expected.items():
        budget = {"max_len": 2} if agg == "seq-mean-token-sum-norm" else {}
        assert value_loss(values, values, returns, mask, clip=None, agg=agg, **budget)[0].item() == pytest.approx(value)
    loss, metrics = value_loss(returns, returns, returns, mask)
    assert loss.item() == 0.0 and metrics["vf_explained_var"].item() == pytest.approx(1.0)


def test_value_loss_bad_arguments():
    v = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip"):
        value_loss(v, v, v, torch.ones(2, 3), clip=0.0)
    with pytest.raises(ValueError, match="agg"):
        value_loss(v, v, v, torch.ones(2, 3), agg="sum")
    with pytest.raises(ValueError, match="returns"):
        value_loss(v, v, torch.zeros(3, 2), torch.ones(2, 3))


VERSIONS = torch.tensor([
    [5, 4, 6, 99],   # oldest valid token is version 4 -> lag 2; the padded 99 is ignored
    [6, 6, 0, 0],    # all tokens current -> lag 0
    [1, 1, 1, 1],    # no valid tokens -> lag 0
])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


def test_policy_lag_uses_the_oldest_valid_token():
    lag = policy_lag(VERSIONS, MASK, current_version=6)
    assert lag.tolist() == [2, 0, 0] and lag.dtype == torch.int64


def test_max_lag_filter():
    assert max_lag_filter(VERSIONS, MASK, 6, max_lag=1).tolist() == [False, True, True]
    assert max_lag_filter(VERSIONS, MASK, 6, max_lag=2).tolist() == [True, True, True]
    assert max_lag_filter(VERSIONS, MASK, 7, max_lag=0).tolist() == [False, False, True]


def test_staleness_bad_arguments():
    with pytest.raises(ValueError, match="newer than current_version"):
        policy_lag(VERSIONS, MASK, current_version=5)
    with pytest.raises(ValueError, match="max_lag"):
        max_lag_filter(VERSIONS, MASK, 6, max_lag=-1)
    with pytest.raises(ValueError, match="token_versions"):
        policy_lag(VERSIONS.float(), MASK, 6)
    with pytest.raises(ValueError, match="mask"):
        policy_lag(VERSIONS, MASK[:, :2], 6)
    with pytest.raises(ValueError, match="current_version"):
        policy_lag(VERSIONS, MASK, 6.5)
