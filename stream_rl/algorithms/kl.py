"""KL estimators between the policy and a reference policy, the in-loss KL term, and the KL-coefficient controllers.

Consumes: per-token log-probabilities of the sampled tokens under the policy (``logp``) and the reference
(``ref_logp``), both ``[B, T]``.
Produces: a per-token estimate ``[B, T]`` of KL(pi || ref) (:func:`kl_penalty`), for the reward (classic PPO:
r_t -= beta * kl_t) or, through :func:`kl_loss`, a 0-dim loss term (GRPO: loss += beta * agg(kl_t)).

Estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html), with
log rho = ref_logp - logp, on tokens y ~ pi:

- ``"k1"`` = -log rho = logp - ref_logp                   unbiased, high variance, can be negative
- ``"k2"`` = 0.5 * (log rho)^2                            biased, low variance, >= 0
- ``"k3"`` = rho - 1 - log rho = exp(log rho) - log rho - 1    unbiased, low variance, >= 0 (computed as expm1(x) - x,
  which is exact near 0 and never rounds below 0)

As a *value* k1 and k3 are unbiased estimates of KL(pi || ref). As a *loss* what matters is the expected gradient of
the sampled estimator, differentiated through logp only (the tokens are data). With sum_y pi grad log pi = 0:

- k1: E_pi[grad log pi] = 0                                       zero expected gradient: useless in a loss
- k2: E_pi[(log pi - log ref) grad log pi] = grad KL(pi || ref)   the reverse KL the RLHF objective regularises
- k3: E_pi[(1 - ref / pi) grad log pi] = -sum_y ref grad log pi = grad KL(ref || pi)   the forward KL

So the in-loss default is k2; k3 (GRPO's KL term, Shao et al. 2024 eq. 4) stays available and is what GRPO papers
use, but its gradient is that of KL(ref || pi); k1 in a loss is rejected. ``tests/unit/test_algorithms_kl_gradients.py``
checks all three by enumerating every token of a small categorical distribution.

The controllers implement the log-space proportional controller of Ziegler et al. 2019, "Fine-Tuning Language
Models from Human Preferences":
e = clip(KL / KL_target - 1, -0.2, 0.2), beta <- beta * (1 + e * n_steps / horizon). :func:`adaptive_kl_coef` is
the pure update; the controller classes only hold the current coefficient between steps.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import as_bool_mask, check_choice, check_float, check_positive, check_same_shape
from .catalogue import KL_KINDS, KL_LOSS_KINDS
from .reductions import aggregate


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str, *, mask: Tensor | None = None) -> Tensor:
    """Per-token KL(pi || ref) estimate ``[B, T]``; ``kind`` is "k1", "k2" or "k3" (formulas in the module doc).

    Formula: with x = ref_logp - logp, k1 = -x, k2 = 0.5 * x^2, k3 = exp(x) - x - 1.
    Reference: Schulman 2020, "Approximating KL Divergence"; k3 is GRPO's KL term (Shao et al. 2024, eq. 4).
    All three are 0 where logp == ref_logp. Gradients flow to both arguments (detach ``ref_logp`` yourself if it
    is not already). With ``mask``, masked positions are 0 and never affect the gradient. Expected gradients on
    tokens sampled from pi (module docstring): k1 0, k2 grad KL(pi || ref), k3 grad KL(ref || pi); for a loss term
    use :func:`kl_loss`.
    """
    logp = check_float(logp, "logp")
    check_same_shape(logp, "logp", ref_logp=ref_logp)
    ref_logp = check_float(ref_logp, "ref_logp")
    check_choice(kind, "kind", KL_KINDS)
    log_rho = ref_logp - logp  # [B, T]
    if mask is not None:
        m = as_bool_mask(mask, logp, "logp")
        log_rho = torch.where(m, log_rho, torch.zeros((), dtype=log_rho.dtype, device=log_rho.device))
    if kind == "k1":
        return -log_rho  # [B, T]
    if kind == "k2":
        return 0.5 * log_rho.square()  # [B, T]
    return torch.expm1(log_rho) - log_rho  # [B, T]


def kl_loss(logp: Tensor, ref_logp: Tensor, mask: Tensor, *, kind: str = "k2", weights: Tensor | None = None,
            agg: str = "token-mean", max_len: int | None = None,
            normaliser: Tensor | float | None = None) -> Tensor:
    """The KL term of the loss: agg(w_t * k(logp_t, ref_logp_t)), a 0-dim tensor (multiply by beta yourself).

    Formula: L_KL = aggregate(sg(w) * kl_penalty(logp, sg(ref_logp), kind), mask, agg); ``kind`` "k2" (expected
    gradient grad KL(pi || ref)) or "k3" (grad KL(ref || pi)); see the module docstring. "k1" raises ValueError: its
    expected gradient is 0. ``weights`` ``[B, T]`` (detached) are the off-policy importance weights pi_prox / mu of the
    policy term: tokens sampled from mu, reweighted, estimate the expectation under pi_prox, which is pi at the first
    update of a batch. ``agg``, ``max_len``, ``normaliser`` as in :func:`~stream_rl.algorithms.reductions.aggregate`.
    Reference: Schulman 2020; Shao et al. 2024 (GRPO's in-loss KL).
    """
    if kind == "k1":
        raise ValueError("kind='k1' has zero expected gradient as a loss term (E_pi[grad log pi] = 0): use 'k2' "
                         "(grad KL(pi || ref)) or 'k3' (grad KL(ref || pi)), or put k1 into the reward")
    check_choice(kind, "kind", KL_LOSS_KINDS)
    per_token = kl_penalty(logp, ref_logp.detach(), kind, mask=mask)  # [B, T]
    if weights is not None:
        check_same_shape(per_token, "logp", weights=weights)
        per_token = per_token * weights.detach()  # [B, T]
    return aggregate(per_token, mask, agg, max_len=max_len, normaliser=normaliser)


def adaptive_kl_coef(coef: float, observed_kl: float | Tensor, n_steps: int, target: float, horizon: float) -> float:
    """One proportional-control update of the KL coefficient (Ziegler et al. 2019).

    Formula: error = clip(observed_kl / target - 1, -0.2, 0.2); new_coef = coef * (1 + error * n_steps / horizon).
    ``observed_kl`` may be a float or a 0-dim tensor; ``target`` and ``horizon`` > 0; ``n_steps`` >= 0.
    """
    coef = float(coef)
    if not 0.0 <= coef < math.inf:
        raise ValueError(f"coef must be a finite number >= 0, got {coef}")
    target = check_positive(target, "target")
    horizon = check_positive(horizon, "horizon")
    if isinstance(n_steps, bool) or int(n_steps) != n_steps or n_steps < 0:
        raise ValueError(f"n_steps must be an integer >= 0, got {n_steps!r}")
    kl = float(observed_kl.detach() if isinstance(observed_kl, Tensor) else observed_kl)
    if math.isnan(kl):
        raise ValueError("observed_kl is NaN")
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


class AdaptiveKLController:
    """Holds the KL coefficient beta and updates it towards a target KL with :func:`adaptive_kl_coef`.

    ``init_coef`` >= 0 is the starting beta (TRL's former PPO defaults: 0.2, with target 6 nats and horizon 10,000
    samples), ``target`` > 0 the desired KL per sequence (or per token, if that is what you observe), ``horizon`` > 0
    the number of samples over which beta may move by at most 20 percent.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        self.value = adaptive_kl_coef(init_coef, target, 0, target, horizon)  # validates all three; no change
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, observed_kl: float | Tensor, n_steps: int) -> float:
        """Apply one update after ``n_steps`` samples (or steps) with mean KL ``observed_kl``; return the new beta."""
        self.value = adaptive_kl_coef(self.value, observed_kl, n_steps, self.target, self.horizon)
        return self.value

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"


class FixedKLController:
    """A constant KL coefficient with the same interface as :class:`AdaptiveKLController`."""

    def __init__(self, coef: float) -> None:
        coef = float(coef)
        if not 0.0 <= coef < math.inf:
            raise ValueError(f"coef must be a finite number >= 0, got {coef}")
        self.value = coef

    def update(self, observed_kl: float | Tensor, n_steps: int) -> float:
        """Return the unchanged coefficient (arguments accepted for interface compatibility)."""
        return self.value

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"
