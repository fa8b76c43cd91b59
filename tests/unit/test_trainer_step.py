"""The training step: direction of the update, NaN/Inf guard, exact gradient accumulation, KL, GAE, schedules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.trainer import exact_logprobs, random_group, scored, tiny_policy, trainer_cfg

from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.forward import proximal_pass
from consumers.trainer.rollout_metrics import rollout_metrics
from consumers.trainer.targets import BatchTargets, advantage_inputs
from consumers.trainer.tensors import build_batch
from consumers.trainer.train_step import TrainState, lr_at, train_step
from consumers.trainer.update import update
from stream_rl import algorithms as alg

torch.set_num_threads(1)
PROMPT = [3, 4, 5]
GOOD, BAD = [6, 7, 8], [9, 10]


def pair(model, **kw):
    return [scored(0, 0, prompt_ids=PROMPT, response_ids=GOOD, reward=1.0,
                   behavior=exact_logprobs(model, PROMPT, GOOD), **kw),
            scored(0, 1, prompt_ids=PROMPT, response_ids=BAD, reward=0.0,
                   behavior=exact_logprobs(model, PROMPT, BAD), **kw)]


def seq_logp(model, response) -> float:
    return float(exact_logprobs(model, PROMPT, response).sum())


def test_one_step_raises_the_positively_advantaged_response_and_lowers_the_other():
    model = tiny_policy(seed=0)
    cfg = trainer_cfg(lr=1e-2)
    before = seq_logp(model, GOOD), seq_logp(model, BAD)
    state = TrainState()
    metrics = train_step(TorchEngine(TrainModule(model), cfg), build_batch(pair(model)), cfg, state)
    after = seq_logp(model, GOOD), seq_logp(model, BAD)
    assert after[0] > before[0] + 0.05 and after[1] < before[1] - 0.05
    assert state.step == 1 and state.applied_updates == 1 and metrics["optim/updates"] == 1.0
    assert metrics["advantage/max"] == pytest.approx(1 / math.sqrt(2), rel=1e-4)  # GRPO, 2 members, std 0.707
    assert metrics["mismatch/logp_abs_diff"] < 1e-5 and metrics["policy/ratio_mean"] == pytest.approx(1.0)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_nan_reward_skips_the_update_and_leaves_weights_and_optimizer_untouched():
    model = tiny_policy(seed=0)
    cfg = trainer_cfg()
    engine = TorchEngine(TrainModule(model), cfg)
    items = pair(model)
    batch = build_batch(items)
    batch.rewards[0] = float("nan")
    before, state = _weights(model), TrainState()
    metrics = train_step(engine, batch, cfg, state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not engine.optimizer.state and all(p.grad is None for p in model.parameters())
    assert metrics["optim/skipped_updates"] == 1.0 and state.skipped_updates == 1 and state.applied_updates == 0
    metrics = train_step(engine, build_batch(items), cfg, state)  # the next clean batch trains normally
    assert metrics["optim/updates"] == 1.0 and state.skipped_updates == 1
    assert not torch.equal(before["lm_head.weight"], model.lm_head.weight)


def test_a_non_finite_gradient_is_refused_by_the_engine():
    model = tiny_policy(seed=0)
    engine = TorchEngine(TrainModule(model), trainer_cfg())
    before = _weights(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model.lm_head.weight.grad[0, 0] = float("inf")
    outcome = engine.step(lr=1e-2)
    assert not outcome.applied and not math.isfinite(outcome.grad_norm)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not engine.optimizer.state


class _Capture(TorchEngine):
    def step(self, lr):
        self.grads = {n: p.grad.detach().clone() for n, p in self.module.named_parameters() if p.grad is not None}
        return super().step(lr)


@pytest.mark.parametrize("agg,kind", [("token-mean", "ppo"), ("seq-mean-token-mean", "ppo"),
                                      ("seq-mean-token-sum-norm", "ppo"), ("token-mean", "gspo"),
                                      ("token-mean", "cispo")])
def test_gradient_accumulation_is_exact_for_every_aggregation(agg, kind):
    ref_model, rng = tiny_policy(seed=5), np.random.default_rng(2)
    model = tiny_policy(seed=0)
    items = [s for p in range(2) for s in random_group(model, p, group_size=2, rng=rng, rewards=[1.0, 0.0],
                                                       ref_model=ref_model)]
    batch = build_batch(items)
    assert len(set(batch.response_mask.sum(-1).tolist())) > 1  # unequal lengths: the normaliser matters
    batch.behavior_logp.add_(0.05 * torch.randn(batch.behavior_logp.shape) * batch.response_mask)
    grads = []
    for micro in (4, 1, 3):  # 3: unequal micro batches (3 + 1 sequences)
        loss = {"agg": agg, "kind": kind, "max_len": 8, "clip_low": 0.2, "clip_high": 0.2}
        cfg = trainer_cfg(micro_batch_size=micro, loss=loss, kl={"coef": 0.1})
        engine = _Capture(TrainModule(tiny_policy(seed=0)), cfg)
        prox_logp = proximal_pass(engine, batch, cfg.micro_batch_size).logp
        kl_t = alg.kl_penalty(prox_logp, batch.ref_logp, "k3", mask=batch.response_mask)
        adv = alg.sequence_to_tokens(alg.grpo_advantages(advantage_inputs(batch, kl_t, 0.1, cfg, None).rewards,
                                                         batch.group_ids), batch.response_mask)
        applied, _, _ = update(engine, batch, BatchTargets(prox_logp - 0.1, adv, None, None),
                               torch.arange(batch.size), cfg, 0.1, lr=1e-3)
        assert applied
        grads.append(engine.grads)
    for other in grads[1:]:
        for name, g in grads[0].items():
            assert torch.allclose(g, other[name], rtol=1e-5, atol=1e-7), name


def test_kl_in_the_loss_reports_and_adapts_the_coefficient():
    model, ref = tiny_policy(seed=0), tiny_policy(seed=9)
    items = [s for p in range(2) for s in random_group(model, p, group_size=2, rng=np.random.default_rng(4),
                                                       rewards=[1.0, 0.0], ref_model=ref)]
    cfg = trainer_cfg(kl={"coef": 0.2, "placement": "loss", "adaptive": True, "target": 0.01, "horizon": 100})
    state = TrainState(kl_coef=0.2)
    metrics = train_step(TorchEngine(TrainModule(model), cfg), build_batch(items), cfg, state)
    assert metrics["kl/ref_mean"] > 0.01 and metrics["loss/kl"] > 0 and metrics["kl/coef"] == 0.2
    assert state.kl_coef == pytest.approx(0.2 * (1 + 0.2 * 4 / 100))  # error clipped at +0.2, 4 sequences


def test_kl_in_the_reward_moves_the_penalty_into_the_rewards_and_missing_refs_fail_loudly():
    items = [scored(0, 0, response_ids=[6, 7], reward=1.0, ref=[-1.0, -1.0], token_rewards=[0.5, 0.0]),
             scored(0, 1, response_ids=[8], reward=0.0, ref=[-2.0])]
    batch = build_batch(items)
    kl_t = torch.tensor([[0.1, 0.3], [0.2, 0.0]])
    x = advantage_inputs(batch, kl_t, 0.5, trainer_cfg(kl={"placement": "reward"}), None)
    # row 0 came with dense token rewards (used as they are), row 1 without (reward on its last token)
    assert torch.allclose(x.token_rewards, torch.tensor([[0.5 - 0.05, 0.0 - 0.15], [0.0 - 0.1, 0.0]]))
    assert torch.allclose(x.rewards, torch.tensor([1.0 - 0.2, -0.1]))
    x = advantage_inputs(batch, kl_t, 0.5, trainer_cfg(kl={"placement": "loss"}), None)
    assert torch.allclose(x.rewards, torch.tensor([1.0, 0.0]))
    model = tiny_policy()
    cfg = trainer_cfg(kl={"coef": 0.1})
    with pytest.raises(ValueError, match="ref_logprobs"):
        train_step(TorchEngine(TrainModule(model), cfg), build_batch(pair(model)), cfg, TrainState(kl_coef=0.1))


@pytest.mark.parametrize("advantage", ["gae", "reinforce_pp", "rloo", "dr_grpo"])
def test_every_estimator_trains(advantage):
    model = tiny_policy(seed=0)
    cfg = trainer_cfg(advantage=advantage, gamma=0.9, lam=0.95, epochs=2, minibatches=2, micro_batch_size=1)
    module = TrainModule(model, value_head=advantage == "gae")
    metrics = train_step(TorchEngine(module, cfg), build_batch(pair(model)), cfg, TrainState())
    assert metrics["optim/updates"] == 4.0 and math.isfinite(metrics["loss/total"])
    if advantage == "gae":
        assert "loss/value" in metrics and float(module.value_head.weight.detach().abs().sum()) > 0
    assert seq_logp(model, GOOD) > -100  # still a sane model


def test_lr_schedule_values():
    cfg = trainer_cfg(lr=1.0, warmup_steps=2, schedule="linear", max_steps=6)
    assert [lr_at(s, cfg) for s in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    cfg = trainer_cfg(lr=1.0, schedule="cosine", max_steps=4)
    assert [lr_at(s, cfg) for s in (0, 2, 4)] == pytest.approx([1.0, 0.5, 0.0])
    with pytest.raises(ValueError):
        trainer_cfg(schedule="cosine")


def test_rollout_metrics_hand_values():
    items = [scored(0, 0, reward=1.0, response_ids=[6, 7], version=3),
             scored(0, 1, reward=0.0, response_ids=[6], version=2),
             scored(1, 0, reward=1.0, response_ids=[6, 7, 8], version=4),
             scored(1, 1, reward=1.0, response_ids=[6], version=4)]
    m = rollout_metrics(items, current_version=4, success_threshold=1.0)
    assert m["reward/mean"] == 0.75 and m["reward/group_success_rate"] == 0.75
    assert m["reward/groups_zero_std"] == 0.5 and m["reward/groups_any_success"] == 1.0
    assert m["staleness/mean_lag"] == 0.75 and m["staleness/max_lag"] == 2.0
    assert m["response/length_mean"] == 1.75 and m["response/length_max"] == 3.0
    assert m["throughput/generate_tokens_per_s"] == pytest.approx(7 / 0.5)  # one producer batch of 0.5 s
    assert m["time/score_s_mean"] == 0.25 and m["reward/verifier"] == 0.75
    assert "time/rollout_age_s_mean" not in m  # only when the trainer says when the step started
    for i, s in enumerate(items):
        s.rollout.timings["created_at"] = 100.0 + i  # generated at 100, 101, 102, 103
    aged = rollout_metrics(items, current_version=4, success_threshold=1.0, now=105.0)
    assert aged["time/rollout_age_s_mean"] == pytest.approx(3.5)  # (5 + 4 + 3 + 2) / 4


class _Counting(TorchEngine):
    forwards = 0

    def forward(self, batch):
        self.forwards += 1
        return super().forward(batch)


def _step_with(recompute: str, **kw):
    model = tiny_policy(seed=0)
    items = [s for p in range(2) for s in random_group(model, p, group_size=2, rng=np.random.default_rng(6),
                                                       rewards=[1.0, 0.0])]
    batch = build_batch(items)
    batch.behavior_logp.add_(0.1 * torch.randn(batch.behavior_logp.shape, generator=torch.Generator().manual_seed(1))
                             * batch.response_mask)  # a stale sampler: weights pi_prox / mu != 1
    cfg = trainer_cfg(micro_batch_size=2, recompute_proximal=recompute, **kw)
    engine = _Counting(TrainModule(model), cfg)
    metrics = train_step(engine, batch, cfg, TrainState())
    return engine.forwards, metrics, _weights(model)


def test_a_single_update_takes_pi_prox_from_its_own_forward_and_trains_exactly_the_same():
    """epochs * minibatches == 1: the proximal pass would recompute what the update's forward computes (ratio 1).
    Skipping it halves the forwards (2 micro batches: 2 instead of 4) and changes no weight and no metric."""
    skipped, fast, after_fast = _step_with("auto")
    always, slow, after_slow = _step_with("always")
    assert (skipped, always) == (2, 4)
    assert fast["batch/proximal_pass"] == 0.0 and slow["batch/proximal_pass"] == 1.0
    for name, w in after_fast.items():
        torch.testing.assert_close(w, after_slow[name], rtol=0, atol=1e-7)
    for key in ("loss/total", "policy/is_weight_mean", "policy/ratio_mean", "policy/entropy", "kl/ref_mean",
                "mismatch/logp_abs_diff", "advantage/std"):
        assert fast[key] == pytest.approx(slow[key], rel=1e-5, abs=1e-7, nan_ok=True), key
    assert fast["policy/is_weight_mean"] != pytest.approx(1.0, abs=1e-3)  # the correction is really exercised


@pytest.mark.parametrize("kw", [{"epochs": 2}, {"minibatches": 2}, {"advantage": "gae"},
                                {"kl": {"coef": 0.1, "placement": "reward"}}])
def test_the_proximal_pass_runs_whenever_something_needs_it(kw):
    from consumers.trainer.train_step import needs_proximal_pass

    cfg = trainer_cfg(**kw)
    assert needs_proximal_pass(cfg, cfg.kl.coef)
    assert not needs_proximal_pass(trainer_cfg(), 0.0)
    assert not needs_proximal_pass(trainer_cfg(kl={"coef": 0.1}), 0.1)  # KL in the loss: computed in the update


def test_the_in_loss_kl_is_weighted_by_the_policy_terms_importance_weights():
    """loss/kl of a single-micro update equals kl_loss(pi_prox, ref, k2, weights = capped pi_prox / mu), computed
    here by hand from a no-grad pass over the same weights."""
    model, ref_model = tiny_policy(seed=0), tiny_policy(seed=9)
    items = [s for p in range(2) for s in random_group(model, p, group_size=2, rng=np.random.default_rng(7),
                                                       rewards=[1.0, 0.0], ref_model=ref_model)]
    batch = build_batch(items)
    batch.behavior_logp.add_(0.3 * torch.randn(batch.behavior_logp.shape, generator=torch.Generator().manual_seed(2))
                             * batch.response_mask)
    cfg = trainer_cfg(micro_batch_size=8, kl={"coef": 0.1}, loss={"is_cap": 1.1})
    engine = TorchEngine(TrainModule(model), cfg)
    mask = batch.response_mask
    prox = proximal_pass(engine, batch, 8).logp
    weights, w_metrics = alg.importance_weights(prox, batch.behavior_logp, mask, is_cap=1.1)
    assert w_metrics["is_clipped_frac"].item() > 0  # the cap is exercised
    expected = alg.kl_loss(prox, batch.ref_logp, mask, kind="k2", weights=weights).item()
    unweighted = alg.kl_loss(prox, batch.ref_logp, mask, kind="k2").item()
    metrics = train_step(engine, batch, cfg, TrainState(kl_coef=0.1))
    assert metrics["loss/kl"] == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(unweighted, rel=1e-3)


def test_gae_advantages_are_whitened_over_the_batch_by_default():
    def adv_stats(**kw):
        model = tiny_policy(seed=0)
        cfg = trainer_cfg(advantage="gae", gamma=1.0, lam=0.95, **kw)
        metrics = train_step(TorchEngine(TrainModule(model, value_head=True), cfg), build_batch(pair(model)), cfg,
                             TrainState())
        return metrics["advantage/mean"], metrics["advantage/std"]

    mean, std = adv_stats()
    assert mean == pytest.approx(0.0, abs=1e-6) and std == pytest.approx(1.0, abs=1e-5)
    mean, std = adv_stats(whiten_advantages=False)
    assert abs(mean) > 1e-3 or abs(std - 1.0) > 1e-3


def test_on_policy_mismatch_averages_only_the_rows_sampled_by_the_weights_held():
    """Hand-computed: row 0 (version 3 everywhere, 2 tokens) |-1.0 - -1.5| = 0.5, |-2.0 - -2.0| = 0; row 1 has one
    token of version 2 (lag 1): excluded; row 2 (version 3, 1 token, padding at version 0) |-0.5 - -0.25| = 0.25.
    Mean over the 3 tokens of rows 0 and 2: (0.5 + 0 + 0.25) / 3 = 0.25."""
    import torch

    from consumers.trainer.train_step import on_policy_mismatch

    mu = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-0.5, 0.0]])
    prox = torch.tensor([[-1.5, -2.0], [-3.0, -3.0], [-0.25, 0.0]])
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    versions = torch.tensor([[3, 3], [3, 2], [3, 0]])
    out = on_policy_mismatch(mu, prox, mask, versions, version=3)
    assert out == {"mismatch/on_policy_samples": 2.0, "mismatch/logp_abs_diff": pytest.approx(0.25)}
    stale = on_policy_mismatch(mu, prox, mask, versions, version=4)
    assert stale == {"mismatch/on_policy_samples": 0.0}  # nothing on policy: the key is absent, not 0
