"""The expected gradient of each KL estimator, computed exactly by enumerating every token of a small vocabulary.

On tokens y ~ pi with the gradient taken through log pi(y) only (the tokens are data), the expectation
sum_y pi(y) * grad k(y) is what a loss term built from the estimator follows on average. Which estimator matches which
divergence (proved in the docstring of ``stream_rl/algorithms/kl.py``):

- k1 = log pi - log ref:            expected gradient 0
- k2 = 0.5 (log pi - log ref)^2:    grad KL(pi || ref)   -> the in-loss default
- k3 = ref/pi - 1 - log(ref/pi):    grad KL(ref || pi)

Everything is float64 and exact (no sampling): the expectations are finite sums over the V tokens.
"""

from __future__ import annotations

import pytest
import torch

from stream_rl.algorithms import kl_loss, kl_penalty

V = 6
THETA = torch.tensor([0.3, -1.2, 0.8, 0.0, 2.0, -0.5], dtype=torch.float64)  # pi = softmax(THETA)
REF = torch.tensor([0.10, 0.25, 0.05, 0.30, 0.10, 0.20], dtype=torch.float64)  # a fixed reference distribution
MU = torch.tensor([0.30, 0.05, 0.15, 0.20, 0.05, 0.25], dtype=torch.float64)  # a behaviour policy, far from pi


def pi_of(theta: torch.Tensor) -> torch.Tensor:
    return torch.softmax(theta, -1)


def estimator_gradient(kind: str, token: int) -> torch.Tensor:
    """grad_theta of kl_penalty at one sampled token y (a [1, 1] batch), the way a loss differentiates it."""
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)[token].reshape(1, 1)
    ref_logp = REF.log()[token].reshape(1, 1)
    kl_penalty(logp, ref_logp, kind).sum().backward()
    return theta.grad


def expected_gradient(kind: str, sampler: torch.Tensor) -> torch.Tensor:
    """sum_y sampler(y) * grad k(y): the exact expectation of the estimator's gradient under ``sampler``."""
    return sum(sampler[y] * estimator_gradient(kind, y) for y in range(V))


def exact_gradient(divergence) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    divergence(pi_of(theta)).backward()
    return theta.grad


def kl_pi_ref(pi):  # KL(pi || ref) = sum pi log(pi / ref)
    return (pi * (pi.log() - REF.log())).sum()


def kl_ref_pi(pi):  # KL(ref || pi) = sum ref log(ref / pi)
    return (REF * (REF.log() - pi.log())).sum()


PI = pi_of(THETA)
GRAD_KL_PI_REF = exact_gradient(kl_pi_ref)
GRAD_KL_REF_PI = exact_gradient(kl_ref_pi)


def test_the_two_divergences_have_different_gradients_here():
    # otherwise the tests below could not tell them apart; also check autograd against the closed forms:
    # grad KL(pi||ref) = pi * (log(pi/ref) - KL(pi||ref)), grad KL(ref||pi) = pi - ref (softmax parameterisation).
    closed_reverse = PI * ((PI.log() - REF.log()) - kl_pi_ref(PI))
    torch.testing.assert_close(GRAD_KL_PI_REF, closed_reverse, rtol=0, atol=1e-12)
    torch.testing.assert_close(GRAD_KL_REF_PI, PI - REF, rtol=0, atol=1e-12)
    assert float((GRAD_KL_PI_REF - GRAD_KL_REF_PI).abs().max()) > 0.05


def test_k1_has_zero_expected_gradient():
    assert float(expected_gradient("k1", PI).abs().max()) < 1e-12


def test_k2_follows_the_gradient_of_kl_pi_ref():
    g = expected_gradient("k2", PI)
    torch.testing.assert_close(g, GRAD_KL_PI_REF, rtol=0, atol=1e-12)
    assert float((g - GRAD_KL_REF_PI).abs().max()) > 0.05


def test_k3_follows_the_gradient_of_kl_ref_pi():
    g = expected_gradient("k3", PI)
    torch.testing.assert_close(g, GRAD_KL_REF_PI, rtol=0, atol=1e-12)
    assert float((g - GRAD_KL_PI_REF).abs().max()) > 0.05


def kl_loss_gradient(kind: str, token: int, weight: float | None) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)[token].reshape(1, 1)
    weights = None if weight is None else torch.full((1, 1), weight, dtype=torch.float64)
    kl_loss(logp, REF.log()[token].reshape(1, 1), torch.ones(1, 1, dtype=torch.bool), kind=kind,
            weights=weights).backward()
    return theta.grad


@pytest.mark.parametrize("kind,target", [("k2", GRAD_KL_PI_REF), ("k3", GRAD_KL_REF_PI)])
def test_kl_loss_on_behaviour_tokens_needs_the_importance_weights(kind, target):
    """Tokens from mu, each weighted by pi / mu (the policy term's weight at the batch's first update), give the
    gradient of the on-policy expectation; unweighted they give another one."""
    weighted = sum(MU[y] * kl_loss_gradient(kind, y, float(PI[y] / MU[y])) for y in range(V))
    torch.testing.assert_close(weighted, target, rtol=0, atol=1e-12)
    unweighted = sum(MU[y] * kl_loss_gradient(kind, y, None) for y in range(V))
    assert float((unweighted - target).abs().max()) > 0.01
