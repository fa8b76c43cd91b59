"""Padding and alignment of scored rollouts, and proximal logprobs that match the sampler's on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.step import proximal_pass
from consumers.trainer.tensors import build_batch, response_logits_slice
from test_trainer_support import exact_logprobs, scored, tiny_policy, trainer_cfg

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
    assert torch.allclose(batch.behavior_logprobs, torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]))
    assert torch.allclose(batch.ref_logprobs, torch.tensor([[-0.5, -0.6, 0.0], [0.0, 0.0, 0.0]]))
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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_proximal_logprobs_equal_behaviour_logprobs_on_the_same_weights(temperature):
    model = tiny_policy(seed=3)
    rng = np.random.default_rng(1)
    items = []
    for i, (p_len, r_len) in enumerate([(2, 5), (6, 1), (4, 3), (3, 4), (5, 2)]):
        prompt = rng.integers(3, 16, p_len).tolist()
        response = rng.integers(3, 16, r_len).tolist()
        items.append(scored(i, 0, prompt_ids=prompt, response_ids=response, group_size=1,
                            behavior=exact_logprobs(model, prompt, response, temperature), temperature=temperature))
    batch = build_batch(items)
    assert (batch.attention_mask[:, 0] == 0).sum() >= 3  # left padding is really exercised
    cfg = trainer_cfg(temperature=temperature, micro_batch_size=2)
    logp, entropy, values = proximal_pass(TorchEngine(TrainModule(model), cfg), batch, cfg)
    mask = batch.response_mask
    assert values is None
    assert float((logp - batch.behavior_logprobs).abs()[mask].max()) < 1e-5
    assert bool((logp[~mask] == 0).all()) and bool((entropy[mask] > 0).all())
