"""End-to-end gradient test: one optimiser step of a tiny causal language model driven by policy_loss.

The model is a one-layer causal transformer built from torch.nn (hidden size 32, vocabulary 16); no download, no
transformers import (which alone takes ~10 s on the 2-core CI machine). Logprobs go through logprobs_from_logits,
so its hand-written backward is exercised inside a real network.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stream_rl.algorithms import LossSpec, grpo_advantages, logprobs_from_logits, policy_loss, sequence_to_tokens

VOCAB, HIDDEN, MAX_LEN = 16, 32, 8


class TinyCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(MAX_LEN, HIDDEN)
        self.block = nn.TransformerEncoderLayer(HIDDEN, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [B, L] -> logits [B, L, V]
        length = tokens.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(length)
        h = self.embed(tokens) + self.position(torch.arange(length))[None]
        return self.head(self.block(h, src_mask=causal, is_causal=True))


def response_logprobs(model: nn.Module, prompt: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Logprobs ``[B, T]`` of each response token given the prompt and the previous response tokens."""
    tokens = torch.cat([prompt.expand(responses.shape[0], -1), responses], dim=1)  # [B, P + T]
    logits = model(tokens)[:, prompt.shape[1] - 1:-1]  # [B, T, V]: position i predicts token i + 1
    return logprobs_from_logits(logits, responses)


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_one_step_raises_the_good_token_and_lowers_the_bad_one(kind):
    torch.manual_seed(0)
    model = TinyCausalLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    prompt = torch.tensor([[3, 7, 1]])  # [1, P]
    # Two sampled responses to the same prompt (one group): reward 1 for token 5 then 2, reward 0 for 9 then 2.
    # The second tokens are identical, but only the first token of each row is a response token we score
    # (the mask pads the rest), so the test also checks that padding stays inert.
    responses = torch.tensor([[5, 2], [9, 2]])  # [B, T]
    mask = torch.tensor([[1, 0], [1, 0]])
    advantages = sequence_to_tokens(grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0])), mask)
    assert advantages[0, 0] > 0 > advantages[1, 0]

    before = response_logprobs(model, prompt, responses).detach()  # [B, T]
    logp = response_logprobs(model, prompt, responses)
    loss, metrics = policy_loss(logp, before, advantages, mask, LossSpec(kind=kind))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    after = response_logprobs(model, prompt, responses).detach()

    assert after[0, 0] > before[0, 0], "the positively-advantaged token must become more likely"
    assert after[1, 0] < before[1, 0], "the negatively-advantaged token must become less likely"
    assert metrics["clipfrac"].item() == 0.0  # first step: ratio 1 everywhere
