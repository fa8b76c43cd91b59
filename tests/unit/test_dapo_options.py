"""DAPO's options without a broker: the dynamic-sampling and overlong formulas against hand-computed values, the
batcher's uniform-group drops, the overlong targets and filter in the step, and the config rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.trainer import exact_logprobs, scored, tiny_policy, trainer_cfg

from consumers.trainer.batcher import Batcher
from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.targets import advantage_inputs, loss_batch
from consumers.trainer.tensors import build_batch
from consumers.trainer.train_step import TrainState, train_step
from producers.budget import Budget
from stream_rl import algorithms as alg
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError

torch.set_num_threads(1)


class Rec:
    """A consumed record: topic, partition, offset and a ScoredRollout value."""

    def __init__(self, value, offset: int):
        self.topic, self.partition, self.offset, self.value = "scored", 0, offset, value


def truncated(s):
    """``s`` with its rollout cut at the length budget."""
    return dataclasses.replace(s, rollout=dataclasses.replace(s.rollout, finish_reason="length"))


def test_overlong_penalty_is_zero_then_a_linear_ramp_then_minus_factor():
    # L_max 10, L_cache 4: free up to 6 tokens; 7 -> (6 - 7) / 4 = -0.25, 9 -> -0.75, 10 -> -1, 11 -> -1
    lengths = torch.tensor([1, 6, 7, 9, 10, 11])
    got = alg.overlong_penalty(lengths, max_len=10, buffer=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert alg.overlong_penalty(lengths, 10, 4, factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.375, -0.5, -0.5]
    assert alg.overlong_penalty(torch.tensor([3, 4]), max_len=4, buffer=4).tolist() == [-0.75, -1.0]


@pytest.mark.parametrize("kwargs, name", [({"max_len": 0, "buffer": 1}, "max_len"),
                                          ({"max_len": 4, "buffer": 5}, "buffer"),
                                          ({"max_len": 4, "buffer": 0}, "buffer"),
                                          ({"max_len": 4, "buffer": 2, "factor": -1.0}, "factor")])
def test_overlong_penalty_names_a_bad_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        alg.overlong_penalty(torch.tensor([1]), **kwargs)


def test_overlong_keep_drops_only_truncated_samples():
    assert alg.overlong_keep(torch.tensor([True, False, True])).tolist() == [False, True, False]


def test_zero_variance_groups_flags_every_member_of_a_group_with_equal_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.25])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 4])  # group ids need not be dense or sorted; a singleton is uniform
    assert alg.zero_variance_groups(rewards, groups).tolist() == [True, True, False, False, True, True, True]
    assert alg.zero_variance_groups(torch.tensor([0.0, 0.1]), torch.tensor([0, 0]), atol=0.1).tolist() == [True] * 2
    # the claim behind it: GRPO advantages of such a group are exactly 0
    adv = alg.grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert adv[:2].tolist() == [0.0, 0.0] and adv[2:].abs().min() > 0.5


def _group(prompt: int, rewards, offset: int, attempt: int = 0) -> list[Rec]:
    return [Rec(scored(prompt, s, group_size=len(rewards), reward=r, attempt=attempt), offset + s)
            for s, r in enumerate(rewards)]


def test_dynamic_sampling_drops_a_uniform_group_to_stale_without_requeue_and_keeps_the_others():
    batcher = Batcher(max_lag=2, uniform_atol=0.0)
    drops = []
    for rec in _group(0, [1.0, 1.0], 0) + _group(1, [1.0, 0.0], 2) + _group(2, [0.0, 0.0], 4):
        drops += batcher.add(rec, current_version=0)
    assert len(drops) == 2 and all(d.requeue is None for d in drops)
    assert [s.prompt_id for d in drops for s in d.stale] == ["p0", "p0", "p2", "p2"]
    assert all("dynamic sampling: all 2 rewards of the group equal" in s.reason and not s.requeued
               for d in drops for s in d.stale)
    assert "equal 1 " in drops[0].reason and "equal 0 " in drops[1].reason
    assert batcher.counters["uniform"] == 4 and batcher.counters["requeued"] == 0
    assert batcher.counters["not_requeued"] == 0  # "not re-queued" counts groups that hit max_requeues
    batch = batcher.take(1)
    assert batch is not None and batch[0].group_id == "p1:0" and batcher.take(1) is None
    batcher.mark_trained(batch)
    assert batcher.safe_offsets() == {("scored", 0): 6}  # dropped and trained: nothing below 6 is held


def test_without_dynamic_sampling_a_uniform_group_is_trained():
    batcher = Batcher(max_lag=2)
    for rec in _group(0, [1.0, 1.0], 0):
        assert batcher.add(rec, current_version=0) == []
    assert batcher.ready_groups == 1 and batcher.counters["uniform"] == 0


def test_a_uniform_drop_returns_the_group_to_the_producers_budget_so_they_sample_more():
    budget = Budget(share=2, versions_ahead=0, start_version=0)
    budget.charge({"p0:0": 2, "p1:0": 2})
    assert budget.over(0, now=0.0)  # two groups in flight, two allowed at version 0
    batcher = Batcher(max_lag=2, uniform_atol=0.0)
    stale = [s for rec in _group(0, [0.0, 0.0], 0) for d in batcher.add(rec, 0) for s in d.stale]
    assert budget.returned_stale(s.group_id for s in stale) == 1
    assert not budget.over(0, now=1.0)  # room for one more group at the same version


def test_batcher_state_round_trip_keeps_the_uniform_counter():
    batcher = Batcher(max_lag=2, uniform_atol=0.0)
    for rec in _group(0, [1.0, 1.0], 0):
        batcher.add(rec, 0)
    again = Batcher.from_state(2, batcher.ledger_state(), uniform_atol=0.0)
    assert again.counters["uniform"] == 2 and again.uniform_atol == 0.0
    with pytest.raises(ValueError, match="uniform_atol"):
        Batcher(max_lag=2, uniform_atol=-1.0)


def test_the_overlong_penalty_is_added_to_the_reward_on_the_last_token():
    cfg = trainer_cfg(advantage="reinforce_pp", overlong={"buffer": 2, "max_len": 3})
    items = [scored(0, 0, response_ids=[6], reward=1.0),  # 1 token: free
             scored(0, 1, response_ids=[6, 7, 8], reward=1.0),  # 3 tokens: (1 - 3) / 2 = -1
             scored(1, 0, response_ids=[6, 7], reward=0.0, token_rewards=[0.25, 0.5])]  # 2: (1 - 2) / 2 = -0.5
    x = advantage_inputs(build_batch(items), None, 0.0, cfg, None)
    assert x.rewards.tolist() == [1.0, 0.0, -0.5]
    assert x.token_rewards.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.25, 0.0, 0.0]]


def test_overlong_filter_masks_truncated_rollouts_out_of_the_loss_only():
    cfg = trainer_cfg(overlong={"filter": True})
    batch = build_batch([scored(0, 0), truncated(scored(0, 1)), scored(1, 0)])
    assert batch.truncated.tolist() == [False, True, False]
    masked = loss_batch(batch, cfg)
    assert masked.response_mask.tolist() == [[True, True], [False, False], [True, True]]
    assert masked.attention_mask.equal(batch.attention_mask)  # the forward still sees the whole sequence
    assert loss_batch(batch, trainer_cfg()) is batch


def _step_delta(items, cfg):
    model = tiny_policy(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = train_step(TorchEngine(TrainModule(model), cfg), build_batch(items), cfg, TrainState())
    return {k: v - before[k] for k, v in model.state_dict().items()}, metrics


def test_with_the_filter_a_truncated_response_does_not_move_the_weights():
    model = tiny_policy(seed=0)
    prompt = [3, 4, 5]

    def member(sample, response, reward, cut=False):
        s = scored(0, sample, group_size=3, prompt_ids=prompt, response_ids=response, reward=reward,
                   behavior=exact_logprobs(model, prompt, response))
        return truncated(s) if cut else s

    cfg = trainer_cfg(overlong={"filter": True}, groups_per_step=1)
    # the group's advantages (rewards 1, 0, 0) are the same in both batches; only the truncated response differs
    a, m_a = _step_delta([member(0, [6, 7], 1.0), member(1, [8], 0.0), member(2, [9, 10, 11], 0.0, cut=True)], cfg)
    b, _ = _step_delta([member(0, [6, 7], 1.0), member(1, [8], 0.0), member(2, [12, 13, 14], 0.0, cut=True)], cfg)
    assert m_a["batch/truncated_fraction"] == pytest.approx(1 / 3)
    assert all(torch.allclose(a[k], b[k], atol=1e-7) for k in a)
    assert any(a[k].abs().max() > 1e-5 for k in a)  # and the step did train the two kept responses
    c, _ = _step_delta([member(0, [6, 7], 1.0), member(1, [8], 0.0), member(2, [12, 13, 14], 0.0, cut=False)],
                       trainer_cfg(groups_per_step=1))
    assert any(not torch.allclose(a[k], c[k], atol=1e-6) for k in a)  # without the filter it counts


def test_overlong_max_len_defaults_to_the_producers_budget_and_the_buffer_must_fit():
    cfg = load_config(None, env={}, overrides={"producer.max_new_tokens": 12, "trainer.overlong.buffer": 4})
    assert cfg.trainer.overlong.max_len == 12
    with pytest.raises(ConfigError, match=r"trainer\.overlong\.buffer=13 > trainer\.overlong\.max_len=12"):
        load_config(None, env={}, overrides={"producer.max_new_tokens": 12, "trainer.overlong.buffer": 13})


def test_dynamic_sampling_is_refused_for_token_level_estimators():
    with pytest.raises(ConfigError, match="dynamic_sampling=true with advantage='gae'"):
        load_config(None, env={}, overrides={"trainer.dynamic_sampling": True, "trainer.advantage": "gae"})
    assert load_config(None, env={}, overrides={"trainer.dynamic_sampling": True}).trainer.dynamic_sampling
