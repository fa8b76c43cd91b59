"""Helpers shared by the trainer tests (no tests here): a tiny Llama, hand-built scored rollouts, configs, and
waiting for a condition."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from consumers.trainer.config import TrainerConfig
from consumers.trainer.tensors import build_batch
from schemas import Rollout, ScoredRollout, group_id_for, rollout_id_for

VOCAB = 16


def tiny_policy(seed: int = 0, vocab: int = VOCAB):
    """LlamaForCausalLM from a config: hidden 64, 2 layers, 2 heads of dim 32, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def trainer_cfg(**overrides) -> TrainerConfig:
    base = {"groups_per_step": 2, "micro_batch_size": 4, "lr": 1e-2, "grad_clip": None, "max_lag": 2}
    base.update(overrides)
    return TrainerConfig(**base)


def scored(prompt: int = 0, sample: int = 0, *, epoch: int = 0, group_size: int = 2, attempt: int = 0,
           prompt_ids=(3, 4, 5), response_ids=(6, 7), behavior=None, versions=None, version: int = 0,
           reward: float = 1.0, ref=None, token_rewards=None, temperature: float = 1.0) -> ScoredRollout:
    """A valid ScoredRollout with explicit tokens (behaviour logprobs default to log(1/2) per token)."""
    n = len(response_ids)
    pid = f"p{prompt}"
    rollout = Rollout(
        rollout_id=rollout_id_for(pid, epoch, sample), prompt_id=pid, epoch=epoch,
        group_id=group_id_for(pid, epoch), sample_index=sample, group_size=group_size,
        prompt_token_ids=np.asarray(prompt_ids, dtype=np.int32),
        response_token_ids=np.asarray(response_ids, dtype=np.int32),
        behavior_logprobs=np.asarray(behavior if behavior is not None else [-0.69] * n, dtype=np.float32),
        token_policy_versions=np.asarray(versions if versions is not None else [version] * n, dtype=np.int64),
        finish_reason="stop", producer_id="producer-0", prompt_text=f"{prompt}+1=", response_text="x",
        answer=str(prompt + 1), metadata={"task": "t"}, attempt=attempt, temperature=temperature,
        timings={"generate_s": 0.5})
    return ScoredRollout(
        rollout=rollout, reward=reward, reward_components={"verifier": reward},
        token_rewards=None if token_rewards is None else np.asarray(token_rewards, dtype=np.float32),
        ref_logprobs=None if ref is None else np.asarray(ref, dtype=np.float32), scorer_id="scorer-0",
        timings={"score_s": 0.25})


@torch.no_grad()
def exact_logprobs(model, prompt_ids, response_ids, temperature: float = 1.0) -> np.ndarray:
    """log p(response | prompt) token by token from ONE unpadded sequence (what an exact sampler reports)."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    logits = model(input_ids=ids).logits[0].float() / temperature  # [L, V]
    logp = torch.log_softmax(logits, -1)
    p = len(prompt_ids)
    return np.array([float(logp[p + t - 1, tok]) for t, tok in enumerate(response_ids)], dtype=np.float32)


def random_group(model, prompt: int, *, group_size: int = 2, rng: np.random.Generator, rewards=None,
                 version: int = 0, temperature: float = 1.0, ref_model=None, **kw) -> list[ScoredRollout]:
    """A group of random prompt/response lengths with exact behaviour (and optionally reference) logprobs."""
    out = []
    prompt_ids = rng.integers(3, VOCAB, rng.integers(2, 6)).tolist()
    for s in range(group_size):
        response_ids = rng.integers(3, VOCAB, rng.integers(1, 6)).tolist()
        beh = exact_logprobs(model, prompt_ids, response_ids, temperature)
        ref = exact_logprobs(ref_model, prompt_ids, response_ids, temperature) if ref_model is not None else None
        reward = float(rewards[s]) if rewards is not None else float(rng.integers(0, 2))
        out.append(scored(prompt, s, group_size=group_size, prompt_ids=prompt_ids, response_ids=response_ids,
                          behavior=beh, version=version, reward=reward, ref=ref, temperature=temperature, **kw))
    return out




def assert_same_gradients(got: dict, want: dict) -> None:
    """Per parameter: float32 sums in another order agree within 1e-5 of each tensor's largest element, and every
    parameter got a gradient to compare."""
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert float((got[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()), name
        assert float(grad.abs().max()) > 0, name


TOPIC = "stream-rl.t.scored"


@dataclass(frozen=True)
class Rec:
    topic: str
    partition: int
    offset: int
    value: Any


def rec(offset: int, prompt: int = 0, sample: int = 0, partition: int = 0, **kw) -> Rec:
    return Rec(TOPIC, partition, offset, scored(prompt, sample, **kw))


def random_batch(model, groups: int = 3, group_size: int = 4, seed: int = 0, temperature: float = 1.0):
    """A batch of ``groups`` random groups of ``model``'s own samples (exact behaviour logprobs)."""
    rng = np.random.default_rng(seed)
    return build_batch([s for p in range(groups)
                        for s in random_group(model, p, group_size=group_size, rng=rng, temperature=temperature)])
