"""CISPO (MiniMax-M1, 2025): loss and gradient against hand-computed values; the clipped weight is detached, so
clipped tokens keep their gradient (unlike PPO); masking, ratio 1, off-policy weights, and spec refusals."""

from __future__ import annotations

import math

import pytest
import torch

from stream_rl.algorithms import AGG_MODES, LossSpec, aggregate, policy_loss

LOG = math.log


def case():
    """One row of three tokens: prox_logp = -1, ratios r = [1.5, 0.5, 1.0], advantages A = [1, -2, 3]."""
    prox_logp = torch.full((1, 3), -1.0, requires_grad=True)  # a leaf: it must get no gradient
    logp = torch.tensor([[-1.0 + LOG(1.5), -1.0 + LOG(0.5), -1.0]], requires_grad=True)
    return logp, prox_logp, torch.tensor([[1.0, -2.0, 3.0]]), torch.ones(1, 3, dtype=torch.bool)


def test_cispo_symmetric_clip_by_hand():
    # clip 0.2 / 0.2: the weight is clip(r, 0.8, 1.2) = [1.2, 0.8, 1.0] (t0 and t1 clipped: clipfrac 2/3).
    # logp = [-1 + ln 1.5, -1 - ln 2, -1] = [-0.594535, -1.693147, -1]; per-token loss -sg(w) * A * logp:
    #   t0: -1.2 * 1 * (-1 + ln 1.5) =  1.2 * (1 - ln 1.5) =  0.713442
    #   t1: -0.8 * -2 * (-1 - ln 2)  = -1.6 * (1 + ln 2)   = -2.709035
    #   t2: -1.0 * 3 * (-1)          =  3
    # token-mean: (0.713442 - 2.709035 + 3) / 3 = 0.334802.
    # d loss / d logp_t = -w_t * A_t / 3 = [-0.4, 0.533333, -1.0]: the clipped t0 and t1 keep their gradient.
    logp, prox_logp, advantages, mask = case()
    loss, metrics = policy_loss(logp, prox_logp, advantages, mask, LossSpec(kind="cispo", clip_low=0.2, clip_high=0.2))
    expected = (1.2 * (1 - LOG(1.5)) - 1.6 * (1 + LOG(2.0)) + 3.0) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.334802, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.4, 1.6 / 3, -1.0]]))
    assert prox_logp.grad is None  # the weight is a constant: no gradient reaches pi_prox
    assert metrics["clipfrac"].item() == pytest.approx(2 / 3)
    assert metrics["ratio_max"].item() == pytest.approx(1.5, abs=1e-6)
    assert metrics["ratio_min"].item() == pytest.approx(0.5, abs=1e-6)
    assert "dual_clipfrac" not in metrics


def test_cispo_default_has_no_lower_bound_as_in_the_paper():
    # The catalogue's defaults: clip_low 1 (weight floor 0: MiniMax-M1 sets no lower bound), clip_high 0.2,
    # token-mean (the paper's 1 / sum_i |o_i|). Weight = [1.2, 0.5, 1.0]: only t0 is clipped (clipfrac 1/3).
    #   t1: -0.5 * -2 * (-1 - ln 2) = -(1 + ln 2) = -1.693147
    # loss = (0.713442 - 1.693147 + 3) / 3 = 0.673432; gradient -w * A / 3 = [-0.4, 0.333333, -1.0].
    spec = LossSpec(kind="cispo")
    assert (spec.clip_low, spec.clip_high, spec.agg, spec.level) == (1.0, 0.2, "token-mean", "token")
    logp, prox_logp, advantages, mask = case()
    loss, metrics = policy_loss(logp, prox_logp, advantages, mask, spec)
    expected = (1.2 * (1 - LOG(1.5)) - (1 + LOG(2.0)) + 3.0) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6) and expected == pytest.approx(0.673432, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.4, 1.0 / 3, -1.0]]))
    assert metrics["clipfrac"].item() == pytest.approx(1 / 3)


def test_clipped_tokens_keep_their_gradient_under_cispo_and_lose_it_under_ppo():
    # The same clip 0.2 / 0.2 with PPO: t0 (A > 0, r = 1.5 > 1.2) and t1 (A < 0, r = 0.5 < 0.8) are clipped, so their
    # gradient is 0; t2 (r = 1) gets -A * r / 3 = -1. CISPO gives t0 and t1 -w * A / 3 = -0.4 and 0.533333.
    grads = {}
    for kind in ("ppo", "cispo"):
        logp, prox_logp, advantages, mask = case()
        loss, _ = policy_loss(logp, prox_logp, advantages, mask, LossSpec(kind=kind, clip_low=0.2, clip_high=0.2))
        loss.backward()
        grads[kind] = logp.grad
    torch.testing.assert_close(grads["ppo"], torch.tensor([[0.0, 0.0, -1.0]]))
    torch.testing.assert_close(grads["cispo"], torch.tensor([[-0.4, 1.6 / 3, -1.0]]))


def test_the_weight_is_detached_the_gradient_flows_through_log_pi_only():
    # At t2 (r = 1, unclipped, A = 3, logp = -1): with sg the gradient is -A * w / 3 = -1. Without sg the weight
    # r = exp(logp - prox) would add -A * logp * r / 3 = +1, giving 0: the -1 above shows that sg is there.
    logp, prox_logp, advantages, mask = case()
    loss, _ = policy_loss(logp, prox_logp, advantages, mask, LossSpec(kind="cispo"))
    loss.backward()
    x = logp.detach().clone().requires_grad_(True)
    undetached = -(torch.exp(x - prox_logp.detach()).clamp(0.0, 1.2) * advantages * x).mean()
    undetached.backward()
    assert logp.grad[0, 2].item() == pytest.approx(-1.0) and x.grad[0, 2].item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_cispo_at_ratio_one_is_reinforce_in_value_and_gradient(agg):
    # logp == prox_logp: every weight is 1, so the per-token loss is exactly -A * logp (REINFORCE), aggregated.
    torch.manual_seed(0)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 2, 4])[:, None]  # [3, 5], right-padded
    logp, advantages = -torch.rand(3, 5) * 3, torch.randn(3, 5)
    x, y = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    budget = {"max_len": 5} if agg == "seq-mean-token-sum-norm" else {}
    loss, metrics = policy_loss(x, logp, advantages, mask, LossSpec(kind="cispo", agg=agg, **budget))
    reference = aggregate(-advantages * y, mask, agg, **budget)
    torch.testing.assert_close(loss, reference)
    loss.backward()
    reference.backward()
    torch.testing.assert_close(x.grad, y.grad)
    assert metrics["clipfrac"].item() == 0.0


def test_masked_tokens_change_neither_cispo_loss_nor_gradient():
    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    logp = -torch.rand(2, 3) * 2
    prox, advantages = logp + 0.3 * torch.randn(2, 3), torch.randn(2, 3)
    results = []
    for fill in (0.0, float("nan"), 1e4):
        x = torch.where(mask, logp, torch.tensor(fill)).requires_grad_(True)
        loss, _ = policy_loss(x, torch.where(mask, prox, torch.tensor(fill)),
                              torch.where(mask, advantages, torch.tensor(fill)), mask, LossSpec(kind="cispo"))
        loss.backward()
        assert bool((x.grad[~mask] == 0).all())
        results.append((loss.detach(), x.grad))
    for other in results[1:]:
        torch.testing.assert_close(other[0], results[0][0])
        torch.testing.assert_close(other[1], results[0][1])


def test_cispo_off_policy_weight_is_per_token():
    # Ratio 1 (logp == prox_logp = -1), A = 1: per-token loss -w_t * logp_t = w_t with w = exp(prox - behavior)
    # = [1, e^0.5 -> capped at 1.5, e^-0.5]; token-mean = (1 + 1.5 + 0.606531) / 3 = 1.035510.
    prox = torch.full((1, 3), -1.0)
    behavior = torch.tensor([[-1.0, -1.5, -0.5]])
    logp = prox.clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, prox, torch.ones(1, 3), torch.ones(1, 3), LossSpec(kind="cispo", is_cap=1.5),
                                behavior_logp=behavior)
    assert loss.item() == pytest.approx((1 + 1.5 + math.exp(-0.5)) / 3, abs=1e-6)
    assert metrics["is_clipped_frac"].item() == pytest.approx(1 / 3)


def test_cispo_refuses_the_dual_clip_it_does_not_use():
    with pytest.raises(ValueError, match=r"dual_clip=3\.0 does not apply to kind='cispo'"):
        LossSpec(kind="cispo", dual_clip=3.0)
