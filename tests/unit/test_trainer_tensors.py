"""Padding and alignment of scored rollouts, and proximal logprobs that match the sampler's on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.trainer import exact_logprobs, scored, tiny_policy, trainer_cfg

from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.forward import proximal_pass
from consumers.trainer.tensors import build_batch, response_logits_slice

torch.set_num_threads(1)


def test_hand_case_layout_and_alignment():
    a = scored(0, 0, prompt_ids=[3, 4, 5], response_ids=[6, 7], behavior=[-0.1, -0.2], version=2, reward=1.0,
               ref=[-0.5, -0.6], token_rewards=[0.0, 0.25])
    b = scored(1, 0, prompt_ids=[8], response_ids=[9, 10, 11], behavior=[-0.3, -0.4, -0.5], versions=[1, 2, 2],
               reward=0.0)
    batch = build_batch([a, b], pad_token_id=0)
    assert batch.prompt_width == 3 and batch.response_width == 3
    assert batch.input_ids.tolist() == [[3, 4, 5, 6, 7, 0], [0, 0, 8, 9, 10, 11]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert batch.response_ids.tolist() == [[6, 7, 0], [9, 10, 11]]
    assert batch.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert torch.allclose(batch.behavior_logp, torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]))
    assert torch.allclose(batch.ref_logp, torch.tensor([[-0.5, -0.6, 0.0], [0.0, 0.0, 0.0]]))
    assert batch.has_ref.tolist() == [True, False]
    assert torch.allclose(batch.token_rewards, torch.tensor([[0.0, 0.25, 0.0], [0.0, 0.0, 0.0]]))
    assert batch.token_versions.tolist() == [[2, 2, 0], [1, 2, 2]]
    assert batch.rewards.tolist() == [1.0, 0.0] and batch.group_ids.tolist() == [0, 1]
    # the logits at P - 1 + t predict response token t, which sits at P + t in input_ids
    cut = response_logits_slice(batch.prompt_width, batch.response_width)
    assert (cut.start, cut.stop) == (2, 5)
    for row in range(2):
        for t in range(3):
            if batch.response_mask[row, t]:
                assert batch.input_ids[row, batch.prompt_width + t] == batch.response_ids[row, t]
                assert batch.attention_mask[row, cut.start + t] == 1


def test_select_keeps_the_widths_and_group_ids_are_dense_by_first_appearance():
    items = [scored(4, 0, response_ids=[6]), scored(2, 0, response_ids=[6, 7, 8]), scored(4, 1, response_ids=[6])]
    batch = build_batch(items)
    assert batch.group_ids.tolist() == [0, 1, 0]
    sub = batch.select(torch.tensor([2]))
    assert sub.size == 1 and sub.response_width == 3 and sub.prompt_width == batch.prompt_width
    assert sub.n_tokens == 1
    with pytest.raises(ValueError):
        build_batch([])


def test_a_batch_mixing_temperatures_gives_each_row_the_logprobs_of_its_own_temperature():
    """Rollouts sampled at T = 0.7, 1.0 and 1.3 share a batch; each row is scored under softmax(logits / its own T)."""
    model = tiny_policy(seed=3)
    rng = np.random.default_rng(1)
    items, temps = [], [0.7, 1.0, 0.7, 1.3, 1.0]
    for i, ((p_len, r_len), t) in enumerate(zip([(2, 5), (6, 1), (4, 3), (3, 4), (5, 2)], temps)):
        prompt = rng.integers(3, 16, p_len).tolist()
        response = rng.integers(3, 16, r_len).tolist()
        items.append(scored(i, 0, prompt_ids=prompt, response_ids=response, group_size=1,
                            behavior=exact_logprobs(model, prompt, response, t), temperature=t))
    batch = build_batch(items)
    assert (batch.attention_mask[:, 0] == 0).sum() >= 3  # left padding is really exercised
    assert batch.temperatures.tolist() == pytest.approx(temps)
    cfg = trainer_cfg(micro_batch_size=2)
    prox = proximal_pass(TorchEngine(TrainModule(model), cfg), batch, cfg.micro_batch_size)
    mask = batch.response_mask
    assert prox.values is None
    assert float((prox.logp - batch.behavior_logp).abs()[mask].max()) < 1e-5
    assert bool((prox.logp[~mask] == 0).all()) and bool((prox.entropy[mask] > 0).all())
    # and it is the temperature that does it: the same tokens at T = 1 give other numbers on the T != 1 rows
    at_one = [exact_logprobs(model, it.rollout.prompt_token_ids, it.rollout.response_token_ids) for it in items]
    for b, t in enumerate(temps):
        n = int(mask[b].sum())
        differs = float(abs(prox.logp[b, :n].numpy() - at_one[b]).max()) > 1e-3
        assert differs == (t != 1.0), b
