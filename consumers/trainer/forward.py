"""Forward passes of the trainer: per-token logprobs of the response under each rollout's own temperature.

Consumes: an engine (:mod:`consumers.trainer.engines`) and a :class:`~consumers.trainer.tensors.RolloutBatch`.
Produces: ``logp`` ``[B, T]`` float32 (and optionally the entropy ``[B, T]`` and the value head's ``[B, T]``).
Guarantees:
- The data decides the temperature: row b's logits are divided by that rollout's own sampling temperature
  (``RolloutBatch.temperatures[b]``, from ``Rollout.temperature``), so rollouts sampled at T = 0.7 and T = 1.0 can
  share a batch and each is scored under the distribution it was sampled from.
- The 1/T scale is folded into the chunked kernels of ``stream_rl.algorithms.logprobs``: no full ``[B, T, V]``
  float32 copy of the logits is made, whatever their dtype (bf16 included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from consumers.trainer.tensors import RolloutBatch
from stream_rl import algorithms as alg


def evaluate(engine, batch: RolloutBatch, *, entropy: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
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
def proximal_pass(engine, batch: RolloutBatch, micro_batch_size: int) -> Proximal:
    """pi_prox logprobs, entropy and values of the current weights, micro batch by micro batch; 0 on padding."""
    parts = [evaluate(engine, batch.select(idx), entropy=True)
             for idx in torch.arange(batch.size).split(micro_batch_size)]
    mask = batch.response_mask.to(parts[0][0].device)
    logp = torch.where(mask, torch.cat([p[0] for p in parts]), 0.0)
    ent = torch.where(mask, torch.cat([p[1] for p in parts]), 0.0)
    values = None if parts[0][2] is None else torch.where(mask, torch.cat([p[2] for p in parts]), 0.0)
    return Proximal(logp, ent, values)
