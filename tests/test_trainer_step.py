"""The training step: direction of the update, NaN/Inf guard, exact gradient accumulation, KL, GAE, schedules."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.step import (TrainState, advantage_inputs, lr_at, proximal_pass, rollout_metrics,
                                    train_step, update, BatchTargets)
from consumers.trainer.tensors import build_batch
from stream_rl import algorithms as alg
from test_trainer_support import exact_logprobs, random_group, scored, tiny_policy, trainer_cfg

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
                                      ("seq-mean-token-sum-norm", "ppo"), ("token-mean", "gspo")])
def test_gradient_accumulation_is_exact_for_every_aggregation(agg, kind):
    ref_model, rng = tiny_policy(seed=5), np.random.default_rng(2)
    model = tiny_policy(seed=0)
    items = [s for p in range(2) for s in random_group(model, p, group_size=2, rng=rng, rewards=[1.0, 0.0],
                                                       ref_model=ref_model)]
    batch = build_batch(items)
    assert len(set(batch.response_mask.sum(-1).tolist())) > 1  # unequal lengths: the normaliser matters
    batch.behavior_logprobs.add_(0.05 * torch.randn(batch.behavior_logprobs.shape) * batch.response_mask)
    grads = []
    for micro in (4, 1, 3):  # 3: unequal micro batches (3 + 1 sequences)
        cfg = trainer_cfg(micro_batch_size=micro, loss={"agg": agg, "kind": kind}, kl={"coef": 0.1})
        engine = _Capture(TrainModule(tiny_policy(seed=0)), cfg)
        old_logp, _, _ = proximal_pass(engine, batch, cfg)
        kl_t = alg.kl_penalty(old_logp, batch.ref_logprobs, "k3", mask=batch.response_mask)
        adv = alg.sequence_to_tokens(alg.grpo_advantages(advantage_inputs(batch, kl_t, 0.1, cfg, None).rewards,
                                                         batch.group_ids), batch.response_mask)
        applied, _, _ = update(engine, batch, BatchTargets(old_logp - 0.1, adv, None, None),
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
