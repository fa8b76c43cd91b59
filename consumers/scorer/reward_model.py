"""Reward-model scores of rollouts: a one-label sequence classifier on prompt + response, batched.

Consumes: rollouts and a frozen ``AutoModelForSequenceClassification`` with ``num_labels == 1`` (loaded strictly by
:func:`stream_rl.models.loading.load_reward_model`, or given directly) and, in ``"text"`` mode, its tokenizer.
Produces: one float score per rollout (the classifier's logit, upcast to float32 whatever dtype the model runs in).

Inputs: ``"tokens"`` mode feeds ``prompt_token_ids + response_token_ids`` as they are (the reward model shares
the policy's tokenizer; ids are checked against its vocabulary). ``"text"`` mode re-tokenises
``prompt_text + response_text`` with the reward model's own tokenizer (any tokenizer; special tokens added as the
tokenizer does by default).

Pooling: transformers' classifiers score the rightmost token that is not ``config.pad_token_id``. Batches are
right-padded with that id, so each row's score is the score of the row run alone (the same rule applies to an
unpadded row: a final real token equal to the pad id is skipped in both cases). A model whose config has no
``pad_token_id`` is refused, since it could not pool a padded batch.

Guarantees: float scores in input order, no gradients; ``token_ids`` raises ValueError with the reason for a
rollout the model cannot take. Finiteness is checked by the caller (:mod:`consumers.scorer.scoring`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from consumers.scorer.reference import check_token_ids, right_pad
from schemas import Rollout


class RewardModelScorer:
    """Batched scores of a one-label sequence classifier (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *,
                 input_mode: Literal["tokens", "text"] = "tokens", batch_size: int = 16,
                 device: str | torch.device = "cpu"):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if input_mode not in ("tokens", "text"):
            raise ValueError(f"input_mode must be 'tokens' or 'text', got {input_mode!r}")
        if model.config.num_labels != 1:
            raise ValueError(f"a reward model needs num_labels=1, got {model.config.num_labels}")
        text_config = model.config.get_text_config()
        if text_config.pad_token_id is None:
            raise ValueError("the reward model's config has no pad_token_id: it could not find the last token of a "
                             "padded batch (set config.pad_token_id)")
        if input_mode == "text" and tokenizer is None:
            raise ValueError("input_mode='text' needs the reward model's tokenizer")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.input_mode = input_mode
        self.batch_size = batch_size
        self.pad_id = int(text_config.pad_token_id)
        self.vocab_size = int(text_config.vocab_size)
        self.max_positions = getattr(text_config, "max_position_embeddings", None)

    @classmethod
    def from_dir(cls, path: str | os.PathLike, *, input_mode: Literal["tokens", "text"] = "tokens",
                 dtype: str = "float32", batch_size: int = 16,
                 device: str | torch.device = "cpu") -> RewardModelScorer:
        """Load the reward model and its tokenizer strictly from a local directory, its weights in ``dtype``
        (``scorer.dtype``: float32, bfloat16 or float16)."""
        from stream_rl.models import load_reward_model, torch_dtype

        model, tokenizer = load_reward_model(path, dtype=torch_dtype(dtype), device=device)
        return cls(model, tokenizer, input_mode=input_mode, batch_size=batch_size, device=device)

    def token_ids(self, rollout: Rollout) -> np.ndarray:
        """The ids this model scores for ``rollout``; raises ValueError with the reason if it cannot take them."""
        if self.input_mode == "tokens":
            ids = np.concatenate([rollout.prompt_token_ids, rollout.response_token_ids])
        else:
            ids = np.asarray(self.tokenizer(rollout.prompt_text + rollout.response_text)["input_ids"],
                             dtype=np.int64)
            if ids.size == 0:
                raise ValueError("the reward model's tokenizer produced no tokens for prompt + response")
        check_token_ids([("prompt + response", ids)], self.vocab_size, self.max_positions, "reward model")
        return ids

    def scores(self, sequences: Sequence[np.ndarray]) -> list[float]:
        """One score per id sequence (from :meth:`token_ids`), in order."""
        out: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            out.extend(self._batch(sequences[start:start + self.batch_size]))
        return out

    @torch.inference_mode()
    def _batch(self, sequences: Sequence[np.ndarray]) -> list[float]:
        ids, mask = right_pad(sequences, self.pad_id, self.device)  # [B, L]
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, 1], pooled
        return [float(v) for v in logits[:, 0].float().cpu()]
