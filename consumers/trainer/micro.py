"""Micro batches of a minibatch: a fixed number of sequences, or filled by token count
(``trainer.max_tokens_per_micro_batch``).

Consumes: the rows of a minibatch (``[n]`` int64 indices into a :class:`~consumers.trainer.tensors.RolloutBatch`),
the batch (for each row's token count), ``trainer.micro_batch_size``, ``trainer.max_tokens_per_micro_batch`` and
whether the forward packs (``trainer.packing``).
Produces: this rank's micro batches as ``(index, real)`` pairs, the shape :meth:`~consumers.trainer.ranks.Ranks.chunks`
gives (``real`` False: a ghost, one row weighted 0 that keeps the ranks in lockstep).
Guarantees:
- Without a token budget the plan is :meth:`Ranks.chunks`'s, unchanged.
- With a budget C, a row's cost is what the forward computes for it: its real tokens n_b = P_b + R_b with packing
  (packed rows carry no padding), else the batch's padded width L = P + T (every row of a micro batch is L wide).
  Greedy in the minibatch's order::

      costs [5, 3, 3, 2, 6], C = 8, micro_batch_size 4  ->  [0, 1] (8) | [2, 3] (5) | [4] (6)

  a row joins the open micro batch while its tokens stay <= C and it has fewer than ``micro_batch_size`` rows; a
  row costing more than C alone gets a micro batch of its own (a sequence is never split).
- Every micro loss is divided by the minibatch's one normaliser (:mod:`~consumers.trainer.update`), so any split
  of the rows gives the same loss and gradients up to float rounding: the budget changes memory, not the result.
- Data parallel: every rank holds the same batch, so each computes every rank's plan (rank r takes the r-th of
  ``world`` near-equal contiguous parts of the rows) and pads its own with ghosts to the longest: the same number
  of micro batches everywhere, with no collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from consumers.trainer.ranks import Ranks
from consumers.trainer.tensors import RolloutBatch


def fill_by_tokens(costs: Sequence[int], budget: int, max_rows: int) -> list[list[int]]:
    """Positions ``0 .. len(costs) - 1`` cut greedily into runs of total cost <= ``budget`` and at most
    ``max_rows`` each (a single position costing more than ``budget`` is a run of its own)."""
    runs: list[list[int]] = []
    used = budget + 1  # nothing open yet
    for i, cost in enumerate(costs):
        if runs and used + cost <= budget and len(runs[-1]) < max_rows:
            runs[-1].append(i)
            used += cost
        else:
            runs.append([i])
            used = cost
    return runs


def row_costs(batch: RolloutBatch, rows: Tensor, packed: bool) -> list[int]:
    """Tokens the forward computes for each of ``rows``: P_b + R_b with packing, else the padded width P + T."""
    if packed:
        return batch.attention_mask.index_select(0, rows.to(batch.device)).sum(-1).tolist()  # [n]
    return [int(batch.input_ids.shape[1])] * len(rows)


def micro_batches(ranks: Ranks, batch: RolloutBatch, rows: Tensor, micro_batch_size: int,
                  max_tokens: int | None, packed: bool = False) -> list[tuple[Tensor, bool]]:
    """This rank's micro batches of ``rows`` as ``(index, real)`` (module docstring)."""
    if max_tokens is None:
        return ranks.chunks(rows, micro_batch_size)
    plans = []
    for part in rows.tensor_split(ranks.world):  # rank r's share: the r-th contiguous part
        runs = fill_by_tokens(row_costs(batch, part, packed), max_tokens, micro_batch_size) if len(part) else []
        plans.append([part[torch.tensor(run, device=part.device)] for run in runs])
    mine = plans[ranks.rank]
    ghosts = max(len(p) for p in plans) - len(mine)
    return [(idx, True) for idx in mine] + [(rows[:1], False)] * ghosts
