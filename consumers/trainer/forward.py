"""Forward passes of the trainer: per-token logprobs of the response under each rollout's own temperature.

Consumes: an engine (:mod:`consumers.trainer.engines`) and a :class:`~consumers.trainer.tensors.RolloutBatch`.
Produces: ``logp`` ``[B, T]`` float32 (and optionally the entropy ``[B, T]`` and the value head's ``[B, T]``).
Guarantees:
- The data decides the temperature: row b's logits are divided by that rollout's own sampling temperature
  (``RolloutBatch.temperatures[b]``, from ``Rollout.temperature``), so rollouts sampled at T = 0.7 and T = 1.0 can
  share a batch and each is scored under the distribution it was sampled from.
- The 1/T scale is folded into the chunked kernels of ``stream_rl.algorithms.logprobs``: no full ``[B, T, V]``
  float32 copy of the logits is made, whatever their dtype (bf16 included).
- With several ranks the proximal pass is sharded: each rank evaluates its own rows (the lockstep plan of
  :meth:`~consumers.trainer.ranks.Ranks.chunks`) and one sum over ranks gives every rank the whole batch's values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

import torch
from torch import Tensor

from consumers.trainer.micro import micro_batches
from consumers.trainer.tensors import RolloutBatch
from stream_rl import algorithms as alg

if TYPE_CHECKING:
    from consumers.trainer.engines import TrainEngine


def response_logprobs(engine: TrainEngine, batch: RolloutBatch, *,
                      entropy: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Logprobs ``[B, T]`` of the response tokens under softmax(logits / T_b), optional entropy and values."""
    logits, values = engine.forward(batch)  # [B, T, V] in the engine's dtype, [B, T] | None
    temperature = batch.temperatures.to(logits.device)  # [B]
    logp = alg.logprobs_from_logits(logits, batch.response_ids, temperature=temperature)  # [B, T]
    ent = alg.entropy_from_logits(logits.detach(), temperature=temperature) if entropy else None  # [B, T]
    return logp, ent, values


@dataclass(frozen=True)
class Proximal:
    """pi_prox of a batch: what the current weights give before the batch's first update (``[B, T]`` each)."""

    logp: Tensor
    entropy: Tensor
    values: Tensor | None


@torch.no_grad()
def proximal_pass(engine: TrainEngine, batch: RolloutBatch, micro_batch_size: int,
                  max_tokens: int | None = None) -> Proximal:
    """pi_prox logprobs, entropy and values of the current weights, micro batch by micro batch (at most
    ``micro_batch_size`` rows and, when set, ``max_tokens`` tokens each: :mod:`~consumers.trainer.micro`); 0 on
    padding."""
    ranks, mask = engine.ranks, batch.response_mask
    zeros = lambda: torch.zeros(batch.response_ids.shape, device=batch.device)  # noqa: E731  [B, T]
    logp, ent = zeros(), zeros()
    values = zeros() if engine.module.value_head is not None else None
    rows = torch.arange(batch.size, device=batch.device)
    for idx, real in micro_batches(ranks, batch, rows, micro_batch_size, max_tokens, engine.module.packing):
        lp, en, v = response_logprobs(engine, batch.select(idx), entropy=True)  # a ghost keeps the ranks in lockstep
        if real:
            assert en is not None  # entropy=True
            logp[idx], ent[idx] = lp.float(), en.float()
            if values is not None:
                values[idx] = v
    logp, ent = (torch.where(mask, ranks.sum_(t), 0.0) for t in (logp, ent))
    values = torch.where(mask, ranks.sum_(values), 0.0) if values is not None else None
    return Proximal(logp, ent, values)
