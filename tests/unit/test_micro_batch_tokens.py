"""Micro batches filled by token count (trainer.max_tokens_per_micro_batch): the plan by hand, the ranks kept in
lockstep, and the same loss and gradients as today's fixed-size micro batches (padded and packed)."""

from __future__ import annotations

import pytest
import torch
from support.taps import GradientTap
from support.trainer import assert_same_gradients, random_batch, scored, tiny_policy, trainer_cfg

from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.micro import fill_by_tokens, micro_batches, row_costs
from consumers.trainer.ranks import Ranks
from consumers.trainer.tensors import build_batch
from consumers.trainer.train_step import TrainState, train_step
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError

torch.set_num_threads(1)


def test_fill_by_tokens_cuts_greedily_within_the_budget_and_the_row_cap():
    assert fill_by_tokens([5, 3, 3, 2, 6], 8, 4) == [[0, 1], [2, 3], [4]]  # the module docstring's example
    assert fill_by_tokens([5, 3, 3, 2, 6], 8, 1) == [[0], [1], [2], [3], [4]]  # micro_batch_size still caps rows
    assert fill_by_tokens([9, 2, 2], 8, 4) == [[0], [1, 2]]  # a row over the budget is alone, never split
    assert fill_by_tokens([2, 2, 2, 2], 8, 4) == [[0, 1, 2, 3]]  # exactly the budget fits
    assert fill_by_tokens([], 8, 4) == []


def _lengths_batch():
    """Prompt + response lengths 3+2, 1+2, 2+1, 1+1: P = 3, T = 2, padded width L = 5."""
    rows = [([3, 4, 5], [6, 7]), ([8], [9, 10]), ([11, 12], [13]), ([14], [15])]
    return build_batch([scored(0, s, group_size=4, prompt_ids=p, response_ids=r) for s, (p, r) in enumerate(rows)])


def test_a_row_costs_its_real_tokens_packed_and_the_padded_width_otherwise():
    batch = _lengths_batch()
    rows = torch.tensor([3, 0, 2])
    assert row_costs(batch, rows, packed=True) == [2, 5, 3]
    assert row_costs(batch, rows, packed=False) == [5, 5, 5]
    plan = micro_batches(Ranks(), batch, torch.arange(4), 4, 6, packed=True)  # costs 5, 3, 3, 2
    assert [(i.tolist(), real) for i, real in plan] == [([0], True), ([1, 2], True), ([3], True)]
    plan = micro_batches(Ranks(), batch, torch.arange(4), 4, 10, packed=False)  # 5 each: two rows per micro batch
    assert [i.tolist() for i, _ in plan] == [[0, 1], [2, 3]]
    no_budget = micro_batches(Ranks(), batch, torch.arange(4), 3, None)
    assert [i.tolist() for i, _ in no_budget] == [i.tolist() for i, _ in Ranks().chunks(torch.arange(4), 3)]


def test_every_rank_gets_the_same_number_of_micro_batches_ghosts_filling_in():
    batch = _lengths_batch()
    rows = torch.tensor([0, 3, 1, 2])  # rank 0: rows 0, 3 (costs 5, 2); rank 1: rows 1, 2 (costs 3, 3)
    plans = [micro_batches(Ranks(rank=r, world=2), batch, rows, 4, 6, packed=True) for r in range(2)]
    assert [(i.tolist(), real) for i, real in plans[0]] == [([0], True), ([3], True)]
    assert [(i.tolist(), real) for i, real in plans[1]] == [([1, 2], True), ([0], False)]  # a ghost: row 0, weight 0
    real = sorted(r for plan in plans for i, ok in plan if ok for r in i.tolist())
    assert real == [0, 1, 2, 3]  # every row once


def _step(batch, **cfg_kw):
    cfg = trainer_cfg(share_prompts=False, **cfg_kw)
    module = TrainModule(tiny_policy(seed=0), value_head=cfg.advantage == "gae", packing=cfg.packing)
    engine = TorchEngine(module, cfg)
    tap = GradientTap(engine)
    return train_step(engine, batch, cfg, TrainState()), tap.grads


@pytest.mark.parametrize("packing,budget,advantage,epochs", [
    (False, 14, "grpo", 1),  # padded width 10 or so: one row per micro batch
    (False, 40, "grpo", 2),  # a few rows each; the proximal pass runs (2 epochs) and is split the same way
    (True, 9, "grpo", 1),  # packed: rows by real tokens
    (True, 16, "gae", 1),  # value head and its loss too
])
def test_token_budgeted_micro_batches_give_the_same_loss_and_gradients(packing, budget, advantage, epochs):
    batch = random_batch(tiny_policy(seed=0), groups=3, group_size=4, seed=5)  # 12 rows of varied lengths
    common = {"packing": packing, "advantage": advantage, "epochs": epochs, "micro_batch_size": 12}
    want, want_grads = _step(batch, **common)  # the whole minibatch in one micro batch
    got, got_grads = _step(batch, max_tokens_per_micro_batch=budget, **common)
    plan = micro_batches(Ranks(), batch, torch.arange(batch.size), 12, budget, packed=packing)
    assert len(plan) >= 3  # the budget really splits the batch
    for key in ("loss/total", "loss/policy", "optim/grad_norm", "policy/entropy", "advantage/std"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert len(got_grads) == len(want_grads) == epochs
    for g, w in zip(got_grads, want_grads):
        assert_same_gradients(g, w)


def test_config_bounds_the_token_budget():
    def load(**overrides):
        return load_config(None, env={}, overrides=overrides)

    assert load().trainer.max_tokens_per_micro_batch is None
    assert load(**{"trainer.max_tokens_per_micro_batch": "4096"}).trainer.max_tokens_per_micro_batch == 4096
    with pytest.raises(ConfigError, match="trainer.max_tokens_per_micro_batch"):
        load(**{"trainer.max_tokens_per_micro_batch": "0"})


def test_the_planner_bounds_a_token_budgeted_micro_batch_by_its_tokens():
    from stream_rl.planner import PlanInputs, make_plan
    from stream_rl.planner import memory as mem
    from stream_rl.planner.model_size import ModelShape

    assert mem.micro_batch_rows(1536, 8, None) == 8
    assert mem.micro_batch_rows(1536, 8, 4096) == 3  # ceil(4096 / 1536)
    assert mem.micro_batch_rows(1536, 2, 4096) == 2  # the row cap still holds
    assert mem.micro_batch_rows(1536, 8, 100) == 1  # a longer sequence alone, never split
    shape = ModelShape(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
                       intermediate_size=128)

    def trainer(**kw):
        plan = make_plan(PlanInputs(model=shape, dtype="fp32", micro_batch=8, seq_len=1536, **kw))
        return dict(next(r for r in plan.colocated.roles if r.role == "trainer").components)

    by_rows, by_tokens = trainer(), trainer(micro_batch_tokens=4096)
    assert by_tokens["activations"] * 8 == by_rows["activations"] * 3  # linear in b: 3 rows instead of 8
    assert by_tokens["logits"] * 8 == by_rows["logits"] * 3
