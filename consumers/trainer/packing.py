"""Sequence packing (``trainer.packing``): a micro batch's sequences laid end to end in rows of one width, run
once, and the outputs mapped back to the padded layout the loss reads.

Consumes: the trainer's padded rows (layout in :mod:`consumers.trainer.tensors`)::

    input_ids[b] = [pad ... pad | prompt_b (P_b) | response_b (R_b) | pad ... pad]      width L = P + T

Produces: a :class:`Packing` (pure: packed ids, position ids, segments, and the index of every padded column's
packed slot), the block-diagonal causal mask of its rows, :func:`unpack` back to the padded layout and, with
:func:`packed_forward`, the logits ``[B, T, V]`` predicting the T response tokens and the last hidden state
``[B, T, H]`` at the same positions: the tensors of one padded forward up to float rounding (tested, gradients
included), with 0 past each response (entries every loss masks out).

Layout: first-fit decreasing over the sequence lengths n_b = P_b + R_b, into rows of width
W = max(``trainer.pack_length``, longest n_b of the micro batch); ``.`` is padding, digits name the padded row::

    padded [B = 4, L = 3 + 2]       packed [R = 3, W = 5]   position ids   row 1's mask (1: query sees key)
    b0: p p p | r r   n_b = 5       row 0: 0 0 0 0 0        0 1 2 3 4      1 . . . .
    b1: . . p | r r   n_b = 3       row 1: 1 1 1 3 3        0 1 2 0 1      1 1 . . .
    b2: . p p | r .   n_b = 3       row 2: 2 2 2 . .        0 1 2 0 0      1 1 1 . .
    b3: . . p | r .   n_b = 2                                              . . . 1 .
                                                                           . . . 1 1

Guarantees:
- A sequence is never split: every row holds whole sequences, and the width is at least the longest sequence, so a
  ``pack_length`` shorter than a sequence widens that micro batch's rows (:func:`first_fit` itself refuses a
  sequence longer than its width, naming it).
- Each token keeps the position id its padded row gives it (``cumsum(mask) - 1``: 0 at each sequence's first
  token), so the rotary phases are those of the padded forward and of generation.
- Query i of a row sees key j iff both hold the same sequence and j <= i: each sequence sees exactly its own
  causal prefix. The padding at the end of a row is one more segment, never read back; no softmax row is empty.
- The mask is 4-D ``[R, 1, W, W]``, which Hugging Face models use as given (``masking_utils``): boolean for
  ``sdpa``, additive float (0 / dtype min) for ``eager``; other attention implementations are refused, and so
  are models whose layers use sliding-window attention narrower than a row (a custom mask replaces the window)
  or that soft-cap their logits (the logits here are the output embedding of the last hidden state).

Cost: every linear layer runs on R * W token positions instead of B * L; attention on R * W * W scores instead of
B * L * L (a masked score is still computed by the CPU and math kernels); the output embedding runs only on the
sum of R_b positions that predict response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Attention implementations that take a 4-D mask, and the mask each wants: None boolean, else additive in a dtype.
MASK_DTYPES: dict[str, torch.dtype | None] = {"sdpa": None, "eager": torch.float32}


def first_fit(lengths: Sequence[int], width: int) -> list[tuple[int, int]]:
    """``(row, offset)`` of each sequence: first-fit decreasing, longest first (ties in batch order), each into
    the first row with ``width - used >= n_b`` room, else a new row. A length above ``width`` is a ValueError."""
    for b, n in enumerate(lengths):
        if n > width:
            raise ValueError(f"sequence {b} has {n} tokens, more than the packed row width {width} (a sequence is "
                             f"never split across rows)")
    room: list[int] = []  # free tokens left in each row
    slots = [(0, 0)] * len(lengths)
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if free >= lengths[b]), len(room))
        if row == len(room):
            room.append(width)
        slots[b] = (row, width - room[row])
        room[row] -= lengths[b]
    return slots


def row_width(lengths: Sequence[int], pack_length: int | None) -> int:
    """W = max(pack_length, longest sequence); the longest sequence when ``pack_length`` is None."""
    return max(max(lengths), pack_length or 0)


@dataclass(frozen=True)
class Packing:
    """B padded rows packed into R rows of width W (shapes in the comments; L = P + T the padded width)."""

    input_ids: Tensor  # [R, W] int64, pad_id on padding
    position_ids: Tensor  # [R, W] int64: each token's padded position id, 0 on padding
    segments: Tensor  # [R, W] int64: the padded row b a slot holds, -1 on padding
    token_index: Tensor  # [B, L] int64: flat slot r * W + c of each padded column, -1 on padding

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    def response_index(self, response_width: int) -> Tensor:
        """Flat slots ``[B, T]`` of the positions predicting the response tokens (padded columns P - 1 .. P + T - 2,
        as :func:`~consumers.trainer.tensors.response_logits_slice`), -1 past each response."""
        total = self.token_index.shape[1]  # L
        prompt_width = total - response_width  # P
        predicting = self.token_index[:, prompt_width - 1:total - 1]  # [B, T]
        return torch.where(self.token_index[:, prompt_width:] >= 0, predicting, -1)  # [B, T]


def pack(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, pack_length: int | None = None,
         pad_id: int = 0) -> Packing:
    """Pack the valid tokens of the padded rows ``[B, L]`` (layout in the module docstring)."""
    valid = attention_mask.bool()  # [B, L]
    lengths = valid.sum(1).tolist()  # n_b
    width = row_width(lengths, pack_length)
    row, offset = (torch.tensor(v, device=input_ids.device) for v in zip(*first_fit(lengths, width)))  # [B] each
    rows = int(row.max()) + 1
    rank = valid.long().cumsum(1) - 1  # [B, L]: index of each valid token within its sequence
    token_index = torch.where(valid, (row * width + offset)[:, None] + rank, -1)  # [B, L]
    slots = token_index[valid]  # [N]
    owner = torch.arange(len(lengths), device=input_ids.device)[:, None].expand_as(valid)[valid]  # [N]

    def scattered(values: Tensor, fill: int) -> Tensor:  # [N] -> [R, W]
        out = torch.full((rows * width,), fill, dtype=torch.int64, device=input_ids.device)
        return out.index_put_((slots,), values.to(torch.int64)).view(rows, width)

    return Packing(input_ids=scattered(input_ids[valid], pad_id), position_ids=scattered(position_ids[valid], 0),
                   segments=scattered(owner, -1), token_index=token_index)


def block_causal_mask(segments: Tensor, additive: torch.dtype | None = None) -> Tensor:
    """Mask ``[R, 1, W, W]``: query i sees key j iff ``segments[i] == segments[j]`` and j <= i. Boolean (True:
    attend), or with ``additive`` a float mask of that dtype: 0 where attended, its most negative value elsewhere."""
    width = segments.shape[1]
    column = torch.arange(width, device=segments.device)
    causal = column[None, :] <= column[:, None]  # [W, W]: key j <= query i
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal  # [R, W, W]
    if additive is not None:
        allowed = torch.zeros(allowed.shape, dtype=additive, device=segments.device).masked_fill_(
            ~allowed, torch.finfo(additive).min)
    return allowed[:, None]  # [R, 1, W, W]


def unpack(packed: Tensor, index: Tensor) -> Tensor:
    """``packed [R, W, *F]`` read at the flat slots ``index [B, N]`` -> ``[B, N, *F]``, 0 where index is -1."""
    out = packed.flatten(0, 1)[index.clamp_min(0)]  # [B, N, *F]
    keep = (index >= 0).view(*index.shape, *([1] * (packed.dim() - 2)))
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def check_policy(policy: nn.Module, width: int) -> torch.dtype | None:
    """The mask kind ``policy`` takes (see :data:`MASK_DTYPES`); ValueError for a policy packing cannot run
    exactly (the module docstring lists why)."""
    config = policy.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASK_DTYPES:
        raise ValueError(f"trainer.packing needs attention 'sdpa' or 'eager' (a 4-D block mask); the policy uses "
                         f"{impl!r}")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()) and window and window < width:
        raise ValueError(f"trainer.packing: the policy's sliding window ({window}) is narrower than a packed row "
                         f"({width}); a block mask would replace the window")
    if getattr(config, "final_logit_softcapping", None):
        raise ValueError("trainer.packing: the policy soft-caps its logits (final_logit_softcapping), so they are "
                         "not the output embedding of the last hidden state")
    return MASK_DTYPES[impl]


def packed_forward(policy: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                   response_width: int, hidden: bool = False,
                   pack_length: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Logits ``[B, T, V]`` predicting the T response tokens (and the last hidden state ``[B, T, H]`` with
    ``hidden``) from one forward of the packed rows; 0 past each response (see the module docstring)."""
    packing = pack(input_ids, attention_mask, position_ids, pack_length)
    mask = block_causal_mask(packing.segments, check_policy(policy, packing.width))  # [R, 1, W, W]
    out = policy(input_ids=packing.input_ids, attention_mask=mask, position_ids=packing.position_ids,
                 logits_to_keep=1, output_hidden_states=True, use_cache=False)
    last = out.hidden_states[-1]  # [R, W, H]: the final norm's output, what the output embedding reads
    index = packing.response_index(response_width)  # [B, T]
    valid = index >= 0  # [B, T]: every response token (multi-turn environment tokens too: the loss masks them)
    predicted = policy.get_output_embeddings()(last.flatten(0, 1)[index[valid]])  # [N, V], N = sum R_b
    logits = predicted.new_zeros((*index.shape, predicted.shape[-1]))  # [B, T, V]
    logits[valid] = predicted
    return logits, unpack(last, index) if hidden else None
