"""Scored rollouts -> padded training tensors, with the response tokens aligned to the logits that predict them.

Consumes: a list of ``ScoredRollout`` (``prompt_token_ids`` [P_b], ``response_token_ids`` [R_b] and the per-token
arrays of length R_b: behaviour logprobs, token versions, optional token rewards and reference logprobs).
Produces: a :class:`RolloutBatch` of torch tensors (pure: no model, no I/O).
Guarantees: one layout for the whole batch, so micro batches cut from it share the widths P and T::

    input_ids[b]   = [pad ... pad | prompt_b (P_b) | response_b (R_b) | pad ... pad]     width L = P + T
                      <- left pad, P - P_b ->        <- T = max R_b, right pad ->
    position_ids   = cumsum(attention_mask) - 1 (0 on padding): identical to what ``generate`` used on a
                     left-padded prompt, so recomputed logprobs match the sampler's
    response_*[b]  = [B, T] right-padded (valid tokens are a prefix, the ``stream_rl.algorithms`` convention)
    response_mask  = [B, T] the tokens the policy sampled: all response tokens, except in a multi-turn rollout
                     (``Rollout.policy_mask``), whose environment tokens are attended (attention_mask 1) but get
                     no loss, so its mask has holes (only the sequence-level estimators accept that)

Response token t of row b sits at ``input_ids[b, P + t]`` and is predicted by the logits at position ``P + t - 1``:
``logits[:, P - 1 : P + T - 1]`` lines up with ``response_ids`` (see :func:`response_logits_slice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor

from schemas import ScoredRollout


@dataclass(frozen=True)
class RolloutBatch:
    """Padded tensors of B rollouts (shapes in the comments; P prompt width, T response width, L = P + T)."""

    input_ids: Tensor  # [B, L] int64
    attention_mask: Tensor  # [B, L] int64
    position_ids: Tensor  # [B, L] int64
    response_ids: Tensor  # [B, T] int64
    response_mask: Tensor  # [B, T] bool: tokens the policy sampled (multi-turn: not the environment's; may have holes)
    behavior_logp: Tensor  # [B, T] float32, 0 on padding: mu, the producer's (Rollout.behavior_logprobs)
    ref_logp: Tensor  # [B, T] float32, 0 on padding and where has_ref is False (ScoredRollout.ref_logprobs)
    has_ref: Tensor  # [B] bool: the scorer attached reference logprobs
    token_versions: Tensor  # [B, T] int64, 0 on padding
    rewards: Tensor  # [B] float32: sequence-level reward
    token_rewards: Tensor  # [B, T] float32, 0 where the scorer gave none
    has_token_rewards: Tensor  # [B] bool: the scorer attached token-level rewards
    group_ids: Tensor  # [B] int64: dense index of the group id string, in order of first appearance
    temperatures: Tensor  # [B] float32: sampling temperature of each rollout
    truncated: Tensor  # [B] bool: the response was cut at the length budget (Rollout.finish_reason == "length")
    prompt_width: int  # P

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_width(self) -> int:
        return int(self.response_ids.shape[1])

    @property
    def n_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def response_lengths(self) -> Tensor:
        """``[B]`` int64: every response token of each row, the policy's and (multi-turn) the environment's."""
        return self.attention_mask[:, self.prompt_width:].sum(-1)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def _map(self, fn) -> RolloutBatch:
        """A batch with ``fn`` applied to every tensor field (the widths P and T are kept)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(**{k: fn(v) if isinstance(v, Tensor) else v for k, v in values.items()})

    def select(self, index: Tensor) -> RolloutBatch:
        """The rows ``index`` (a 1-D index tensor, on any device), keeping the widths P and T."""
        index = index.to(self.device)
        return self._map(lambda t: t.index_select(0, index))

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same batch with every tensor on ``device`` (itself when it is there already)."""
        return self if torch.device(device) == self.device else self._map(lambda t: t.to(device))


def response_logits_slice(prompt_width: int, response_width: int) -> slice:
    """Positions of the logits that predict the response tokens: ``[P - 1, P + T - 1)``."""
    return slice(prompt_width - 1, prompt_width + response_width - 1)


def _padded(rows: Sequence[np.ndarray], width: int, dtype: torch.dtype, left: bool = False) -> Tensor:
    out = torch.zeros(len(rows), width, dtype=dtype)
    for b, row in enumerate(rows):
        n = len(row)
        values = torch.from_numpy(np.ascontiguousarray(row)).to(dtype)
        if left:
            out[b, width - n:] = values
        else:
            out[b, :n] = values
    return out


def dense_group_ids(group_ids: Sequence[str]) -> Tensor:
    """Group id strings -> int64 ``[B]``, numbered by first appearance."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.int64)


def build_batch(scored: Sequence[ScoredRollout], pad_token_id: int = 0) -> RolloutBatch:
    """Pad and align ``scored`` into a :class:`RolloutBatch` (layout in the module docstring)."""
    if not scored:
        raise ValueError("build_batch needs at least one scored rollout")
    rollouts = [s.rollout for s in scored]
    prompts = [r.prompt_token_ids for r in rollouts]
    responses = [r.response_token_ids for r in rollouts]
    p_width = max(len(p) for p in prompts)
    t_width = max(len(r) for r in responses)
    prompt_ids = _padded(prompts, p_width, torch.int64, left=True)  # [B, P]
    prompt_mask = _padded([np.ones(len(p)) for p in prompts], p_width, torch.int64, left=True)  # [B, P]
    response_ids = _padded(responses, t_width, torch.int64)  # [B, T]
    present = _padded([np.ones(len(r)) for r in responses], t_width, torch.bool)  # [B, T] every response token
    policy = _padded([r.policy_mask if r.policy_mask is not None else np.ones(len(r.response_token_ids))
                      for r in rollouts], t_width, torch.bool)  # [B, T] multi-turn: 0 on environment tokens
    response_mask = present & policy  # [B, T]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, L]
    attention_mask = torch.cat([prompt_mask, present.long()], dim=1)  # [B, L] environment tokens are attended
    input_ids = input_ids.masked_fill(attention_mask == 0, pad_token_id)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # [B, L]
    zeros: list[Any] = [np.zeros(len(r), dtype=np.float32) for r in responses]
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_ids=response_ids,
        response_mask=response_mask,
        behavior_logp=_padded([r.behavior_logprobs for r in rollouts], t_width, torch.float32),
        ref_logp=_padded([s.ref_logprobs if s.ref_logprobs is not None else z for s, z in zip(scored, zeros)],
                             t_width, torch.float32),
        has_ref=torch.tensor([s.ref_logprobs is not None for s in scored], dtype=torch.bool),
        token_versions=_padded([r.token_policy_versions for r in rollouts], t_width, torch.int64),
        rewards=torch.tensor([s.reward for s in scored], dtype=torch.float32),
        token_rewards=_padded([s.token_rewards if s.token_rewards is not None else z
                               for s, z in zip(scored, zeros)], t_width, torch.float32),
        has_token_rewards=torch.tensor([s.token_rewards is not None for s in scored], dtype=torch.bool),
        group_ids=dense_group_ids([r.group_id for r in rollouts]),
        temperatures=torch.tensor([r.temperature for r in rollouts], dtype=torch.float32),
        truncated=torch.tensor([r.finish_reason == "length" for r in rollouts], dtype=torch.bool),
        prompt_width=p_width,
    )
