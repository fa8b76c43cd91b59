"""A ``top_p < 1`` run's off-policy correction uses the truncated behaviour logprobs (issue 28, item 5).

The hf engine samples a tiny real Llama under top-p/top-k; a trainer step on those rollouts, with the weights that
sampled them, weights each token by ``w_t = exp(pi_prox(y_t) - mu(y_t))`` where pi_prox is the trainer's full
tempered softmax and mu the truncated one the engine reported. Same weights on both sides makes the hand value
simple: ``mu(y_t) = pi(y_t) / Z_t`` with ``Z_t`` the full-softmax mass of the kept set, so ``w_t = Z_t`` (<= 1):
the trainer's ``policy/is_weight_mean`` / ``_max`` must equal the mean / max over tokens of the kept mass,
computed here by summing the full softmax over the kept set, not through the engine's code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.trainer import exact_logprobs, scored, tiny_policy, trainer_cfg

from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.tensors import build_batch
from consumers.trainer.train_step import TrainState, train_step
from producers.engines.base import Sampling
from producers.engines.hf import HFEngine
from producers.engines.truncation import truncated_logprobs
from stream_rl.demo.tokenizer import build_tokenizer

torch.set_num_threads(1)
PROMPTS = [[1, 4, 13, 5, 14], [1, 9, 9, 13, 3, 12, 14]]  # "1+2=", "66+09="
TEMPERATURE = 0.9
TRUNCATED = Sampling(temperature=TEMPERATURE, top_k=8, top_p=0.7)


def kept_mass(model, prompt: list[int], response: list[int]) -> np.ndarray:
    """``Z_t`` [R]: the full tempered softmax summed over the tokens the truncation keeps at each position."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response[:-1]])).logits[0, len(prompt) - 1:].float()
    kept = torch.isfinite(truncated_logprobs(logits, TRUNCATED))  # [R, V]
    full = torch.softmax(logits / TEMPERATURE, dim=-1)  # [R, V]
    return (full * kept).sum(-1).numpy()


def rollouts(model, behaviour: Sampling):
    """Two groups of two samples drawn under TRUNCATED; behaviour logprobs as ``behaviour`` scores them."""
    engine = HFEngine(model, build_tokenizer())  # freezes this copy: the trainer gets its own, same seed
    groups = engine.generate(PROMPTS, n=2, sampling=TRUNCATED, max_new_tokens=6, seed=0)
    items, masses = [], []
    for p, (prompt, group) in enumerate(zip(PROMPTS, groups, strict=True)):
        for i, sample in enumerate(group):
            beh = sample.logprobs if behaviour == TRUNCATED else exact_logprobs(model, prompt, sample.token_ids,
                                                                                TEMPERATURE)
            items.append(scored(p, i, prompt_ids=prompt, response_ids=sample.token_ids, behavior=beh,
                                reward=float(i), temperature=TEMPERATURE))
            masses.append(kept_mass(model, prompt, sample.token_ids))
    return items, np.concatenate(masses)


def step(items) -> dict[str, float]:
    """One trainer step, on a copy of the weights that sampled ``items``."""
    cfg = trainer_cfg(micro_batch_size=4, lr=1e-3)  # one micro batch: the step's metrics are this batch's
    model = tiny_policy(seed=0, vocab=15)
    return train_step(TorchEngine(TrainModule(model), cfg), build_batch(items), cfg, TrainState())


def test_the_trainer_weights_each_token_by_the_kept_mass_under_truncated_behaviour_logprobs():
    model = tiny_policy(seed=0, vocab=15)
    items, mass = rollouts(model, TRUNCATED)
    assert mass.min() < 0.9  # the truncation removed real mass: weights visibly below 1
    metrics = step(items)
    assert metrics["policy/is_weight_mean"] == pytest.approx(float(mass.mean()), abs=1e-5)
    assert metrics["policy/is_weight_max"] == pytest.approx(float(mass.max()), abs=1e-5)
    assert metrics["policy/is_clipped_frac"] == 0.0  # w <= 1: the cap never bites


def test_full_softmax_behaviour_logprobs_on_the_same_tokens_give_weight_one():
    """The control: had the engine reported the full softmax, the same tokens would get w = 1, so the weights
    above come from the truncated values."""
    model = tiny_policy(seed=0, vocab=15)
    items, _ = rollouts(model, Sampling(TEMPERATURE))
    metrics = step(items)
    assert metrics["policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["policy/is_weight_max"] == pytest.approx(1.0, abs=1e-5)
