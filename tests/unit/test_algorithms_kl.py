"""kl_penalty estimators and the KL-coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch

from stream_rl.algorithms import AdaptiveKLController, FixedKLController, adaptive_kl_coef, kl_loss, kl_penalty


def test_estimators_by_hand():
    # x = ref_logp - logp = [-1, 1, 0].
    # k1 = -x = [1, -1, 0]; k2 = x^2 / 2 = [0.5, 0.5, 0]; k3 = e^x - x - 1 = [e^-1, e - 2, 0] = [0.367879, 0.718282, 0].
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref_logp = torch.tensor([[-2.0, -1.0, -0.5]])
    torch.testing.assert_close(kl_penalty(logp, ref_logp, "k1"), torch.tensor([[1.0, -1.0, 0.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref_logp, "k2"), torch.tensor([[0.5, 0.5, 0.0]]))
    torch.testing.assert_close(kl_penalty(logp, ref_logp, "k3"), torch.tensor([[math.exp(-1), math.e - 2, 0.0]]))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_zero_when_the_policies_agree(kind):
    torch.manual_seed(0)
    logp = -torch.rand(4, 7) * 5
    out = kl_penalty(logp, logp.clone(), kind)
    assert bool((out == 0).all())


def test_k3_and_k2_are_non_negative_even_for_tiny_and_huge_differences():
    torch.manual_seed(1)
    logp = -torch.rand(64, 64) * 10
    scales = torch.logspace(-9, 1, 64)[:, None]  # differences from 1e-9 up to 10
    ref_logp = logp + torch.randn(64, 64) * scales
    assert bool((kl_penalty(logp, ref_logp, "k3") >= 0).all())
    assert bool((kl_penalty(logp, ref_logp, "k2") >= 0).all())


def test_k3_estimates_the_true_kl_and_k1_is_unbiased():
    # Sampling y ~ p from two categorical distributions: E_p[k1] = E_p[k3] = KL(p || q).
    torch.manual_seed(2)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    true_kl = float((p * (p / q).log()).sum())
    samples = torch.multinomial(p, 200_000, replacement=True)
    logp, ref_logp = p.log()[samples][None], q.log()[samples][None]
    for kind in ("k1", "k3"):
        assert abs(float(kl_penalty(logp, ref_logp, kind).mean()) - true_kl) < 3e-3


def test_mask_zeroes_positions_and_their_gradient():
    logp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    ref_logp = torch.tensor([[-2.0, 5.0]])
    out = kl_penalty(logp, ref_logp, "k3", mask=torch.tensor([[True, False]]))
    torch.testing.assert_close(out.detach(), torch.tensor([[math.exp(-1), 0.0]]))
    out.sum().backward()
    # d/dlogp (e^(ref - logp) - (ref - logp) - 1) = -e^(ref - logp) + 1 = 1 - e^-1 at the valid token.
    torch.testing.assert_close(logp.grad, torch.tensor([[1 - math.exp(-1), 0.0]]))


def test_adaptive_controller_by_hand():
    # init 0.1, target 6, horizon 10,000.
    # KL 9 over 1000 samples: error = clip(9/6 - 1 = 0.5) = 0.2, coef = 0.1 * (1 + 0.2 * 1000 / 10000) = 0.102.
    # KL 5.4 over 500: error = 5.4/6 - 1 = -0.1, coef = 0.102 * (1 - 0.1 * 500 / 10000) = 0.102 * 0.995 = 0.10149.
    # KL 0 over 10,000: error = clip(-1) = -0.2, coef = 0.10149 * (1 - 0.2) = 0.081192.
    controller = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    assert controller.value == 0.1
    assert controller.update(9.0, 1000) == pytest.approx(0.102)
    assert controller.update(torch.tensor(5.4), 500) == pytest.approx(0.10149)
    assert controller.update(0.0, 10_000) == pytest.approx(0.081192)
    assert controller.value == pytest.approx(0.081192)
    assert adaptive_kl_coef(0.1, 9.0, 1000, 6.0, 10_000) == pytest.approx(0.102)  # the pure form


def test_fixed_controller():
    controller = FixedKLController(0.05)
    assert controller.update(100.0, 10) == 0.05
    assert controller.value == 0.05


def test_bad_arguments_raise_value_errors():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, logp, "k4")
    with pytest.raises(ValueError, match="ref_logp"):
        kl_penalty(logp, torch.zeros(2, 4), "k1")
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0.0, 100)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 6.0, -1)
    with pytest.raises(ValueError, match="coef"):
        AdaptiveKLController(-0.1, 6.0, 100)
    with pytest.raises(ValueError, match="n_steps"):
        AdaptiveKLController(0.1, 6.0, 100).update(1.0, -2)
    with pytest.raises(ValueError, match="observed_kl"):
        AdaptiveKLController(0.1, 6.0, 100).update(float("nan"), 1)
    with pytest.raises(ValueError, match="coef"):
        FixedKLController(float("inf"))


def test_kl_loss_by_hand_and_k1_is_refused():
    # logp = [-1, -2 | pad], ref = [-1.5, -1]: x = ref - logp = [-0.5, 1]; k2 = 0.5 x^2 = [0.125, 0.5];
    # k3 = e^x - x - 1 = [0.106531, 0.718282]. Weights [2, 0.5]: token-mean of w * k2 = (0.25 + 0.25) / 2 = 0.25.
    logp = torch.tensor([[-1.0, -2.0, 9.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    assert kl_loss(logp, ref, mask).item() == pytest.approx((0.125 + 0.5) / 2)  # default k2
    k3 = (math.exp(-0.5) + 0.5 - 1 + math.e - 2) / 2
    assert kl_loss(logp, ref, mask, kind="k3").item() == pytest.approx(k3, abs=1e-6)
    weighted = kl_loss(logp, ref, mask, weights=torch.tensor([[2.0, 0.5, 100.0]]))
    assert weighted.item() == pytest.approx(0.25)
    weighted.backward()  # d/dlogp of 0.5 w (logp - ref)^2 / 2 = w (logp - ref) / 2 = [0.5, -0.25, 0]
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, -0.25, 0.0]]))
    with pytest.raises(ValueError, match="zero expected gradient"):
        kl_loss(logp, ref, mask, kind="k1")
