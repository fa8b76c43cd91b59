"""Admission of scored rollouts against the model the trainer trains: token ids, lengths, float32 range.

Consumes: a ``ScoredRollout`` that passed schema validation, and the :class:`ModelLimits` of the trainer's policy
(vocabulary size and context length from its Hugging Face config, Dr. GRPO's ``trainer.loss.max_len``).
Produces: ``None`` for a record the trainer can train on, else a :class:`Rejection` whose ``reason`` names the
field, the offending value and the limit; the loop dead-letters it (``error_type`` ``AdmissionError``) and drops
its group to the stale topic (see :mod:`consumers.trainer.batcher`).
Guarantees (pure: no Kafka, no torch, no I/O):

- Every token id of the prompt and of the response is in ``[0, vocab_size)``: an id outside the embedding table
  would crash the forward pass (and crash it again on every ``--resume``, at the same offset).
- ``len(prompt) + len(response) <= max_positions`` when the model has a context length
  (``max_position_embeddings``): the position ids of one row go up to that sum minus one.
- ``len(response) <= max_response`` when the loss uses a constant length normaliser (Dr. GRPO's
  ``seq-mean-token-sum-norm`` with ``trainer.loss.max_len``), which refuses longer responses.
- A multi-turn rollout (``Rollout.policy_mask``) whose policy tokens are not a prefix of its response (environment
  output followed by another policy turn) is refused when ``prefix_masks`` is set: the token-level estimators
  (reinforce_pp, gae) walk the response in time and need the loss mask to be a prefix.
- The reward and any token reward are finite in float32 (the trainer's tensors): a reward of 1e300 is a valid
  float64 on the wire and +inf in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas import ScoredRollout
from stream_rl.algorithms.catalogue import TOKEN_LEVEL_ADVANTAGES

ERROR_TYPE = "AdmissionError"
FLOAT32_MAX = float(np.finfo(np.float32).max)
DR_GRPO_AGG = "seq-mean-token-sum-norm"
TOKEN_ESTIMATORS = TOKEN_LEVEL_ADVANTAGES  # per-token advantages (the catalogue's token-level estimators)


@dataclass(frozen=True)
class ModelLimits:
    """What one rollout must fit: the vocabulary, the context (None: unbounded) and the longest response."""

    vocab_size: int
    max_positions: int | None = None
    max_response: int | None = None
    prefix_masks: bool = False

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")

    @classmethod
    def of(cls, model_config: Any, trainer_cfg: Any) -> ModelLimits:
        """The limits of a policy with Hugging Face ``model_config`` trained under ``trainer_cfg``."""
        positions = getattr(model_config, "max_position_embeddings", None)
        loss = trainer_cfg.loss
        max_response = loss.max_len if loss.agg == DR_GRPO_AGG else None
        return cls(int(model_config.vocab_size), int(positions) if positions else None, max_response,
                   trainer_cfg.advantage in TOKEN_ESTIMATORS)


@dataclass(frozen=True)
class Rejection:
    """Why a record cannot be trained on (the dead letter's reason and error type)."""

    reason: str
    error_type: str = ERROR_TYPE


def _token_problem(name: str, ids: np.ndarray, vocab_size: int) -> str | None:
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size == 0:
        return None
    i = int(bad[0])
    return (f"rollout.{name}[{i}] = {int(ids[i])} is outside the policy's vocabulary [0, {vocab_size}) "
            f"({bad.size} such token(s))")


def _length_problem(prompt_len: int, response_len: int, limits: ModelLimits) -> str | None:
    if limits.max_positions is not None and prompt_len + response_len > limits.max_positions:
        return (f"rollout has {prompt_len} prompt + {response_len} response tokens = {prompt_len + response_len}, "
                f"more than the policy's context max_position_embeddings = {limits.max_positions}")
    if limits.max_response is not None and response_len > limits.max_response:
        return (f"rollout.response_token_ids has {response_len} tokens, more than trainer.loss.max_len = "
                f"{limits.max_response} (Dr. GRPO's constant normaliser)")
    return None


def _float32_problem(scored: ScoredRollout) -> str | None:
    if not abs(scored.reward) <= FLOAT32_MAX:
        return f"reward = {scored.reward!r} is not finite in float32 (|reward| <= {FLOAT32_MAX:.4g})"
    if scored.token_rewards is not None and not np.isfinite(scored.token_rewards.astype(np.float32)).all():
        return "token_rewards hold a value that is not finite in float32"
    return None


def _mask_problem(scored: ScoredRollout, limits: ModelLimits) -> str | None:
    mask = scored.rollout.policy_mask
    if not limits.prefix_masks or mask is None or not (np.diff(mask.astype(np.int8)) > 0).any():
        return None
    return ("rollout.policy_mask has a policy turn after environment tokens (multi-turn), which the token-level "
            "estimators (trainer.advantage reinforce_pp, gae) cannot train on: use grpo, dr_grpo or rloo")


def check_scored(scored: ScoredRollout, limits: ModelLimits) -> Rejection | None:
    """``None`` if the trainer can train on ``scored`` under ``limits``, else the first problem found."""
    r = scored.rollout
    problem = (_token_problem("prompt_token_ids", r.prompt_token_ids, limits.vocab_size)
               or _token_problem("response_token_ids", r.response_token_ids, limits.vocab_size)
               or _length_problem(len(r.prompt_token_ids), r.response_length, limits)
               or _float32_problem(scored)
               or _mask_problem(scored, limits))
    return None if problem is None else Rejection(problem)
