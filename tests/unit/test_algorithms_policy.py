"""policy_loss: PPO (clip, clip-higher, dual clip), GSPO, off-policy weights, aggregation modes, masking, metrics."""

from __future__ import annotations

import math

import pytest
import torch

from stream_rl.algorithms import (AGG_MODES, POLICY_LOSS_DEFAULTS, LossSpec, aggregate, importance_weights,
                                  policy_loss)

LOG = math.log


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).requires_grad_(True)


def test_ppo_by_hand():
    # clip 0.2, one row of four tokens, prox_logp = 0 so ratio = exp(logp):
    #   t0: r = 1.5, A =  1: pg_loss1 = -1.5, pg_loss2 = -1.2 -> -1.2 (clipped, no gradient)
    #   t1: r = 0.5, A =  1: pg_loss1 = -0.5, pg_loss2 = -0.8 -> -0.5
    #   t2: r = 1.5, A = -1: pg_loss1 =  1.5, pg_loss2 =  1.2 ->  1.5
    #   t3: r = 0.5, A = -2: pg_loss1 =  1.0, pg_loss2 =  1.6 ->  1.6 (clipped, no gradient)
    # loss = (-1.2 - 0.5 + 1.5 + 1.6) / 4 = 0.35; clipfrac = 2 / 4.
    # d loss / d logp_t = -A_t * r_t / 4 on unclipped tokens = [0, -0.125, 0.375, 0].
    # approx_kl = mean(r - 1 - log r) = (2 * (0.5 - log 1.5) + 2 * (-0.5 - log 0.5)) / 4 = 0.143841.
    logp = leaf([[LOG(1.5), LOG(0.5), LOG(1.5), LOG(0.5)]])
    prox_logp = torch.zeros(1, 4)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -2.0]])
    loss, metrics = policy_loss(logp, prox_logp, advantages, torch.ones(1, 4, dtype=torch.bool))
    assert loss.item() == pytest.approx(0.35, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.125, 0.375, 0.0]]))
    expected_kl = (2 * (0.5 - LOG(1.5)) + 2 * (-0.5 - LOG(0.5))) / 4
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    assert metrics["approx_kl"].item() == pytest.approx(expected_kl, abs=1e-6)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0, abs=1e-6)
    assert metrics["ratio_max"].item() == pytest.approx(1.5, abs=1e-6)
    assert metrics["ratio_min"].item() == pytest.approx(0.5, abs=1e-6)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    assert "is_weight_mean" not in metrics  # on-policy: no importance-weight metrics


def test_clip_higher_by_hand():
    # Same tokens with clip_high = 0.6 (DAPO): t0 is no longer clipped (1.5 < 1.6): pg_loss = -1.5;
    # t3 is still clipped from below (0.5 < 0.8). loss = (-1.5 - 0.5 + 1.5 + 1.6) / 4 = 0.275; clipfrac = 1 / 4.
    logp = leaf([[LOG(1.5), LOG(0.5), LOG(1.5), LOG(0.5)]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -2.0]])
    loss, metrics = policy_loss(logp, torch.zeros(1, 4), advantages, torch.ones(1, 4), LossSpec(clip_high=0.6))
    assert loss.item() == pytest.approx(0.275, abs=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(0.25)


def test_dual_clip_by_hand():
    # r = 4 on both tokens, clip 0.2, dual_clip 3:
    #   t0: A = -1: max(4, 1.2) = 4, then min(4, -3 * A = 3) = 3 (dual clip, no gradient)
    #   t1: A = +1: max(-4, -1.2) = -1.2 (ordinary clip; dual clip only acts on A < 0)
    # loss = (3 - 1.2) / 2 = 0.9; dual_clipfrac = 0.5; clipfrac = 0.5 (t1 only: at t0 pg_loss1 > pg_loss2).
    logp = leaf([[LOG(4.0), LOG(4.0)]])
    loss, metrics = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2),
                                LossSpec(dual_clip=3.0))
    assert loss.item() == pytest.approx(0.9, abs=1e-6)
    assert metrics["dual_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.zeros(1, 2))


def test_gspo_by_hand():
    # Row 0 (3 valid tokens): log-ratios [0.3, -0.1, 0.1] -> mean 0.1, s0 = e^0.1 = 1.105171 (inside [0.8, 1.2]);
    #   sequence advantage = first token's = 2 (the later 9s are ignored): loss0 = -2 * s0 = -2.210342.
    # Row 1 (2 valid tokens + pad): log-ratios [0.5, 0.3] -> mean 0.4, s1 = e^0.4 = 1.491825, A = 1:
    #   max(-1.491825, -1.2) = -1.2 (clipped).
    # token-mean: (3 * loss0 + 2 * -1.2) / 5 = -1.806205; seq-mean-token-mean: (loss0 - 1.2) / 2 = -1.705171;
    # seq-mean-token-sum-norm (budget max_len = 3): (3 * loss0 / 3 + 2 * -1.2 / 3) / 2 = -1.505171. clipfrac = 2 / 5.
    # (PPO's clip 0.2 here, set explicitly: GSPO's own default clip range is 3e-4 / 4e-4.)
    # Gradient (token-mean): each row-0 token carries loss0, so d/dlogp_t = 3/5 * (-2 * s0 / 3) = -2 * s0 / 5.
    s0 = math.exp(0.1)
    loss0 = -2 * s0
    expected = {
        "token-mean": (3 * loss0 - 2.4) / 5,
        "seq-mean-token-mean": (loss0 - 1.2) / 2,
        "seq-mean-token-sum-norm": (loss0 - 0.8) / 2,
    }
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([[2.0, 9.0, 9.0], [1.0, 1.0, 0.0]])
    for agg, value in expected.items():
        logp = leaf([[0.3, -0.1, 0.1], [0.5, 0.3, 123.0]])
        loss, metrics = policy_loss(logp, torch.zeros(2, 3), advantages, mask,
                                    LossSpec(kind="gspo", agg=agg, max_len=3, clip_low=0.2, clip_high=0.2))
        assert loss.item() == pytest.approx(value, abs=1e-6), agg
        assert metrics["clipfrac"].item() == pytest.approx(0.4)
        assert metrics["ratio_max"].item() == pytest.approx(math.exp(0.4), abs=1e-6)
    loss, _ = policy_loss(logp := leaf([[0.3, -0.1, 0.1], [0.5, 0.3, 123.0]]), torch.zeros(2, 3), advantages, mask,
                          LossSpec(kind="gspo", agg="token-mean", clip_low=0.2, clip_high=0.2))
    loss.backward()
    g = -2 * s0 / 5
    torch.testing.assert_close(logp.grad, torch.tensor([[g, g, g], [0.0, 0.0, 0.0]]))


def budget(agg: str, max_len: int = 6) -> dict[str, int]:
    """The generation budget Dr. GRPO's aggregation needs (random_case's rows are at most 6 tokens long)."""
    return {"max_len": max_len} if agg == "seq-mean-token-sum-norm" else {}


def random_case(seed: int, B: int = 4, T: int = 6, equal_lengths: bool = False):
    torch.manual_seed(seed)
    lengths = torch.full((B,), T - 2) if equal_lengths else torch.tensor([T, 1, T - 2, 3])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T], right-padded
    logp = -torch.rand(B, T) * 3
    return logp, logp + torch.randn(B, T) * 0.3, torch.randn(B, T), mask


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_ratio_one_gives_minus_advantage_and_the_reinforce_gradient(kind, agg):
    # logp == prox_logp: every ratio is 1, nothing is clipped, the per-token loss is -A and the gradient that of
    # -A * logp (the REINFORCE / policy-gradient estimator), aggregated the same way.
    logp, _, advantages, mask = random_case(0)
    if kind == "gspo":  # GSPO uses one advantage per sequence: make it constant along each row
        advantages = advantages[:, :1].expand_as(advantages).contiguous()
    x = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, logp, advantages, mask, LossSpec(kind=kind, agg=agg, **budget(agg)))
    torch.testing.assert_close(loss.detach(), aggregate(-advantages, mask, agg, **budget(agg)))
    reference = x.clone().detach().requires_grad_(True)
    aggregate(-advantages * reference, mask, agg, **budget(agg)).backward()
    loss.backward()
    torch.testing.assert_close(x.grad, reference.grad)
    assert metrics["clipfrac"].item() == 0.0 and metrics["approx_kl"].item() == 0.0
    if agg == "token-mean":
        assert loss.item() == pytest.approx(-float(advantages[mask].mean()), abs=1e-6)


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_masked_tokens_change_neither_loss_nor_gradient(kind, agg):
    logp, prox_logp, advantages, mask = random_case(1)
    behavior = prox_logp + torch.randn_like(prox_logp) * 0.2
    garbage = torch.full_like(logp, float("nan"))
    results = []
    for fill in (torch.zeros_like(logp), garbage, torch.full_like(logp, 1e4)):
        x = torch.where(mask, logp, fill).requires_grad_(True)
        loss, metrics = policy_loss(
            x, torch.where(mask, prox_logp, fill), torch.where(mask, advantages, fill), mask,
            LossSpec(kind=kind, agg=agg, is_cap=2.0, dual_clip=3.0, **budget(agg)),
            behavior_logp=torch.where(mask, behavior, -fill))
        loss.backward()
        assert bool((x.grad[~mask] == 0).all())
        results.append((loss.detach(), x.grad, {k: v.item() for k, v in metrics.items()}))
    for other in results[1:]:
        torch.testing.assert_close(other[0], results[0][0])
        torch.testing.assert_close(other[1], results[0][1])
        assert other[2] == pytest.approx(results[0][2])


def test_agg_modes_agree_on_equal_lengths_and_differ_otherwise():
    # Per-token loss, padded width T = 4, generation budget max_len = 4.
    # Unequal lengths 4 and 2: token-mean = (1+2+3+4+5+6) / 6 = 3.5; seq-mean-token-mean = (10/4 + 11/2) / 2 = 4.0;
    #   seq-mean-token-sum-norm = (10/4 + 11/4) / 2 = 2.625. A fully-masked third row changes none of them.
    # Equal lengths 2 and 2: token-mean = seq-mean-token-mean = 2.5; sum-norm = (3/4 + 7/4) / 2 = 1.25 = 2.5 * 2/4.
    nan = float("nan")
    unequal = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, nan, 7.0], [8.0, 8.0, 8.0, 8.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert aggregate(unequal, mask, "token-mean").item() == pytest.approx(3.5)
    assert aggregate(unequal, mask, "seq-mean-token-mean").item() == pytest.approx(4.0)
    assert aggregate(unequal, mask, "seq-mean-token-sum-norm", max_len=4).item() == pytest.approx(2.625)
    equal = torch.tensor([[1.0, 2.0, 9.0, 9.0], [3.0, 4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]])
    assert aggregate(equal, mask, "token-mean").item() == pytest.approx(2.5)
    assert aggregate(equal, mask, "seq-mean-token-mean").item() == pytest.approx(2.5)
    assert aggregate(equal, mask, "seq-mean-token-sum-norm", max_len=4).item() == pytest.approx(1.25)
    # Through policy_loss on random data: equal lengths n = 4 of T = 6 -> first two agree, third is 4/6 of them.
    logp, prox_logp, advantages, mask = random_case(2, equal_lengths=True)
    losses = {agg: policy_loss(logp, prox_logp, advantages, mask, LossSpec(agg=agg, **budget(agg)))[0].item()
              for agg in AGG_MODES}
    assert losses["token-mean"] == pytest.approx(losses["seq-mean-token-mean"], abs=1e-6)
    assert losses["seq-mean-token-sum-norm"] == pytest.approx(losses["token-mean"] * 4 / 6, abs=1e-6)
    logp, prox_logp, advantages, mask = random_case(2)
    losses = {agg: policy_loss(logp, prox_logp, advantages, mask, LossSpec(agg=agg, **budget(agg)))[0].item()
              for agg in AGG_MODES}
    assert losses["token-mean"] != pytest.approx(losses["seq-mean-token-mean"], abs=1e-4)


def test_off_policy_weights_clamp_and_mask_at_the_cap_boundary():
    # Ratio 1 (logp == prox_logp), A = 1, so the per-token loss is -w.
    # log w = prox_logp - behavior_logp = [0, 0.5, -0.5].
    # With is_cap = 1: t0 sits exactly on the cap (w = 1) and is kept as is by both modes; t1 (w = e^0.5 > 1) is
    # clamped to 1 or masked to 0; t2 (w = e^-0.5 = 0.606531) is below the cap and untouched.
    #   clamp: loss = -(1 + 1 + 0.606531) / 3 = -0.868844; mask: loss = -(1 + 0 + 0.606531) / 3 = -0.535510.
    # Raw weights: mean (1 + 1.648721 + 0.606531) / 3 = 1.085084, max e^0.5 = 1.648721; 1 of 3 tokens capped.
    # Gradient: the weights are constants, so d loss / d logp_t = -w_t / 3 and prox_logp gets no gradient.
    prox_logp = torch.tensor([[-1.0, -1.0, -1.0, 0.0]], requires_grad=True)
    behavior = torch.tensor([[-1.0, -1.5, -0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w2 = math.exp(-0.5)
    expected = {"clamp": [1.0, 1.0, w2], "mask": [1.0, 0.0, w2]}
    for mode, weights in expected.items():
        logp = prox_logp.detach().clone().requires_grad_(True)
        loss, metrics = policy_loss(logp, prox_logp, torch.ones(1, 4), mask, LossSpec(is_cap=1.0, is_mode=mode),
                                    behavior_logp=behavior)
        assert loss.item() == pytest.approx(-sum(weights) / 3, abs=1e-6), mode
        loss.backward()
        torch.testing.assert_close(logp.grad, torch.tensor([[-w / 3 for w in weights] + [0.0]]))
        assert prox_logp.grad is None
        assert metrics["is_weight_mean"].item() == pytest.approx((1 + math.exp(0.5) + w2) / 3, abs=1e-6)
        assert metrics["is_weight_max"].item() == pytest.approx(math.exp(0.5), abs=1e-6)
        assert metrics["is_clipped_frac"].item() == pytest.approx(1 / 3)
    # A cap equal to a weight that is not 1 (float32 rounding included) also leaves that weight alone.
    w_exact = float(torch.exp(torch.tensor(0.5)))
    for mode in ("clamp", "mask"):
        _, metrics = policy_loss(prox_logp, prox_logp, torch.ones(1, 4), mask, LossSpec(is_cap=w_exact, is_mode=mode),
                                 behavior_logp=behavior)
        assert metrics["is_clipped_frac"].item() == 0.0


def test_decoupled_ppo_reduces_to_ppo_when_behavior_equals_proximal():
    logp, prox_logp, advantages, mask = random_case(3)
    plain, _ = policy_loss(logp, prox_logp, advantages, mask)
    decoupled, metrics = policy_loss(logp, prox_logp, advantages, mask, LossSpec(is_cap=5.0),
                                     behavior_logp=prox_logp.clone())
    torch.testing.assert_close(decoupled, plain)
    assert metrics["is_weight_mean"].item() == pytest.approx(1.0) and metrics["is_clipped_frac"].item() == 0.0


def test_truncated_is_configuration_matches_its_formula():
    # PipelineRL's truncated IS: L = -logp * A * sg(min(pi / mu, 1 + eps)), here with eps = 0.02. In our terms:
    # prox_logp = logp.detach() (ratio 1), behavior_logp = mu, is_cap = 1.02, is_mode = "clamp".
    logp, _, advantages, mask = random_case(4)
    behavior = logp + torch.randn_like(logp) * 0.05
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, x.detach(), advantages, mask, LossSpec(is_cap=1.02), behavior_logp=behavior)
    loss.backward()
    y = logp.clone().requires_grad_(True)
    weight = torch.exp(y.detach() - behavior).clamp(max=1.02)
    expected = aggregate(-y * advantages * weight, mask, "token-mean")
    expected.backward()
    torch.testing.assert_close(x.grad, y.grad)


def test_no_valid_tokens_gives_zero_loss_and_metrics():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = policy_loss(logp, logp.detach(), torch.ones(2, 3), torch.zeros(2, 3),
                                LossSpec(agg="seq-mean-token-mean"))
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    loss.backward()
    assert bool((logp.grad == 0).all())


def test_extreme_log_ratios_do_not_produce_nan_gradients():
    logp = torch.tensor([[200.0, -200.0]], requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    loss.backward()
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(logp.grad).all())


def test_bad_arguments_raise_value_errors():
    # A bad hyper-parameter is refused when the spec is built, a bad tensor (or a cap without behaviour logprobs)
    # by policy_loss; either way one ValueError naming the argument.
    logp, prox_logp, advantages, mask = random_case(5)
    cases = [
        ({"kind": "trpo"}, {}, "kind"),
        ({"agg": "mean"}, {}, "agg"),
        ({"is_mode": "drop"}, {}, "is_mode"),
        ({"clip_low": 0.0}, {}, "clip_low"),
        ({"clip_low": 1.5}, {}, "clip_low"),
        ({"clip_high": -0.1}, {}, "clip_high"),
        ({"dual_clip": 1.0}, {}, "dual_clip"),
        ({"is_cap": 2.0}, {}, "behavior_logp"),
        ({"is_cap": 0.0}, {"behavior_logp": logp}, "is_cap"),
        ({}, {"behavior_logp": logp[:, :3]}, "behavior_logp"),
    ]
    for spec_kwargs, call_kwargs, name in cases:
        with pytest.raises(ValueError, match=name):
            policy_loss(logp, prox_logp, advantages, mask, LossSpec(**spec_kwargs), **call_kwargs)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, prox_logp, advantages[:, 0], mask)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(logp, prox_logp, advantages, mask[:, :2])


def test_gspo_defaults_are_the_papers_and_its_clip_acts_on_a_sequence_ratio_of_one_plus_or_minus_1e_3():
    # One row of 4 tokens, every log-ratio +1e-3: s = exp(1e-3) = 1.0010005 > 1 + 4e-4, A = 1 > 0, so the clipped term
    # -A * (1 + 4e-4) is the larger one: clipped, the loss is -1.0004 and its gradient 0. A = -1 with log-ratios
    # -1e-3: s = 0.9990005 < 1 - 3e-4: clipped the same way (loss 0.9997). PPO's 0.2 would clip neither.
    assert POLICY_LOSS_DEFAULTS["gspo"] == {"clip_low": 3e-4, "clip_high": 4e-4, "agg": "seq-mean-token-mean"}
    mask = torch.ones(1, 4, dtype=torch.bool)
    for sign, expected in ((1.0, -(1 + 4e-4)), (-1.0, 1 - 3e-4)):
        logp = leaf([[sign * 1e-3] * 4])
        loss, metrics = policy_loss(logp, torch.zeros(1, 4), torch.full((1, 4), sign), mask, LossSpec(kind="gspo"))
        assert loss.item() == pytest.approx(expected, abs=1e-7)
        assert metrics["clipfrac"].item() == 1.0
        loss.backward()
        assert float(logp.grad.abs().max()) == 0.0
        logp = leaf([[sign * 1e-3] * 4])
        loss, metrics = policy_loss(logp, torch.zeros(1, 4), torch.full((1, 4), sign), mask,
                                    LossSpec(kind="gspo", clip_low=0.2, clip_high=0.2))
        assert metrics["clipfrac"].item() == 0.0 and loss.item() == pytest.approx(-sign * math.exp(sign * 1e-3))


def test_gspo_importance_weight_is_the_geometric_mean_of_the_token_weights():
    # log w = prox_logp - behavior_logp = [0.2, -0.4, 0.5] on row 0 (mean 0.1), [0.3] on row 1 (then padding):
    # w_0 = (e^0.2 e^-0.4 e^0.5)^(1/3) = e^0.1 on each of its tokens, w_1 = e^0.3. Token level keeps e^0.2 etc.
    prox = torch.zeros(2, 3)
    behavior = torch.tensor([[-0.2, 0.4, -0.5], [-0.3, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    seq, metrics = importance_weights(prox, behavior, mask, level="sequence")
    e1, e3 = math.exp(0.1), math.exp(0.3)
    torch.testing.assert_close(seq, torch.tensor([[e1, e1, e1], [e3, 0.0, 0.0]]))
    assert metrics["is_weight_mean"].item() == pytest.approx((3 * e1 + e3) / 4)
    geometric = torch.exp(torch.log(torch.tensor([math.exp(0.2), math.exp(-0.4), math.exp(0.5)])).mean())
    assert seq[0, 0].item() == pytest.approx(geometric.item())
    token, _ = importance_weights(prox, behavior, mask)
    torch.testing.assert_close(token[0], torch.tensor([math.exp(0.2), math.exp(-0.4), math.exp(0.5)]))
    capped, metrics = importance_weights(prox, behavior, mask, level="sequence", is_cap=1.2)  # e^0.3 = 1.35 > 1.2
    torch.testing.assert_close(capped, torch.tensor([[e1, e1, e1], [1.2, 0.0, 0.0]]))
    assert metrics["is_clipped_frac"].item() == pytest.approx(1 / 4)
    # policy_loss(kind="gspo") multiplies each sequence's loss by that weight: ratio 1, A = 1 -> loss -w per token;
    # seq-mean-token-mean: (-e^0.1 - e^0.3) / 2
    loss, _ = policy_loss(prox.clone(), prox, torch.ones(2, 3), mask, LossSpec(kind="gspo"), behavior_logp=behavior)
    assert loss.item() == pytest.approx(-(e1 + e3) / 2, abs=1e-6)
