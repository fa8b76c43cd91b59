"""Per-token log-probabilities and entropies from logits, without a full-vocabulary float32 copy.

Consumes: ``logits`` ``[B, T, V]`` in any floating dtype (bf16 in training), possibly a non-contiguous view (the
trainer's ``out.logits[:, -keep:-1]``); ``labels`` ``[B, T]`` integer ids; optionally a sampling ``temperature``
tau: a float, or a tensor ``[B]`` (one per rollout), ``[B, T]`` (one per position) or 0-dim.
Produces: ``[B, T]`` in float32 (float64 for float64 logits), for the distribution softmax(logits / tau).
Guarantees: the only tensor of ``[B, T, V]`` size ever created, forward or backward, is the gradient with respect to
``logits`` (in the dtype of ``logits``, as autograd requires). Everything computed in float32 is computed on a chunk
of at most ``chunk_rows`` flattened rows, so the extra memory is ``chunk_rows * V * 4`` bytes, not ``B * T * V * 4``.
This holds with a temperature too: 1 / tau is computed once in the working dtype (float32; float64 for float64
logits), expanded to one value per flattened row (``[N]``, small), and multiplied into each chunk after its upcast,
inside the kernel, instead of ``logits.float() / tau`` materialising the scaled logits. It also holds for a
non-contiguous 3-D ``logits``: the chunks are read straight from its ``[B, T, V]`` view, no copy is made. (Only a
view of 4 or more dimensions whose leading dimensions cannot be merged, even keeping T apart, is first copied by
``reshape``: a copy in the dtype of ``logits``, never float32.)

How: flatten to N = B * T rows (as a view: ``[N, V]``, or ``[B, T, V]`` read in row-major order when the rows of a
non-contiguous input cannot be merged); gather the label logit z_y (one value per row); compute logsumexp
row-chunk by row-chunk with only the chunk upcast to float32 (and scaled by 1 / tau).
``torch.log_softmax(logits.float())`` would instead allocate the upcast input and the output, two ``[B, T, V]``
float32 tensors, and autograd would keep them for the backward pass.
The backward pass is written by hand for the same reason: it rebuilds softmax one chunk at a time from the saved
per-row logsumexp instead of keeping every chunk alive in the autograd graph. The temperature is a constant: no
gradient flows to it.
No masking here: positions past the response are ordinary rows; multiply by the mask downstream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._checks import check_float, check_positive, check_tensor

# Default float32 working set per chunk: 2**25 elements = 128 MiB (e.g. 221 rows for a 151,936-token vocabulary).
_CHUNK_ELEMENTS = 2**25


def _rows_per_chunk(chunk_rows: int | None, vocab: int) -> int:
    if chunk_rows is None:
        return max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int or None, got {chunk_rows!r}")
    return chunk_rows


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _rows_view(logits: Tensor) -> Tensor:
    """``logits [..., V]`` as a 3-D view ``[M, R, V]`` whose row-major rows are the N = M * R flattened rows.

    ``[1, N, V]`` when the leading dimensions merge into one (any contiguous input), else ``[M, T, V]`` keeping the
    last leading dimension apart (always a view for a 3-D input, e.g. a slice along T). Only when neither is a view
    (4+ dimensions) does ``reshape`` copy, in the dtype of ``logits``.
    """
    vocab = logits.shape[-1]
    try:
        return logits.view(1, -1, vocab)  # [1, N, V]
    except RuntimeError:
        pass
    try:
        return logits.view(-1, logits.shape[-2], vocab)  # [M, T, V]
    except RuntimeError:
        return logits.reshape(1, -1, vocab)  # [1, N, V], a copy in the dtype of logits


def _row_pieces(x: Tensor, start: int, stop: int) -> list[Tensor]:
    """Views of ``x [M, R, V]`` covering flattened rows [start, stop) in order: ``[n, V]`` or ``[k, R, V]`` each."""
    width = x.shape[1]
    m0, r0 = divmod(start, width)
    m1, r1 = divmod(stop, width)
    if m0 == m1 or (m1 == m0 + 1 and r1 == 0):  # within one block of R rows
        return [x[m0, r0:r1 if m0 == m1 else width]]
    pieces = []
    if r0:
        pieces.append(x[m0, r0:])  # tail of block m0
        m0 += 1
    if m1 > m0:
        pieces.append(x[m0:m1])  # whole blocks
    if r1:
        pieces.append(x[m1, :r1])  # head of block m1
    return pieces


def _load(x: Tensor, start: int, stop: int, work: torch.dtype, inv: Tensor | None, *,
          writable: bool = False) -> Tensor:
    """Flattened rows [start, stop) of ``x [M, R, V]`` in the working dtype, times ``inv[start:stop]`` if given.

    Returns ``[n, V]`` and allocates at most one ``[n, V]`` tensor. Unless ``writable``, an unscaled chunk that is
    already one view in the working dtype (float32 logits) is returned as is, uncopied: the caller must not write
    into it. With ``writable`` the result is always a fresh tensor the caller may modify in place.
    """
    scale = None if inv is None else inv[start:stop].unsqueeze(-1)  # [n, 1]
    pieces = _row_pieces(x, start, stop)
    if len(pieces) == 1 and pieces[0].dim() == 2:
        (piece,) = pieces  # [n, V]
        z = piece.to(work, copy=writable)  # [n, V]
        if scale is None:
            return z
        return piece * scale if z is piece else z.mul_(scale)  # the product is taken in the working dtype
    out = torch.empty(stop - start, x.shape[-1], dtype=work, device=x.device)  # [n, V]
    offset = 0
    for piece in pieces:
        rows = piece.shape[0] if piece.dim() == 2 else piece.shape[0] * piece.shape[1]
        out[offset:offset + rows].view(piece.shape).copy_(piece)
        offset += rows
    return out if scale is None else out.mul_(scale)


def _chunked_backward(logits: Tensor, inv: Tensor | None, lse: Tensor, grad_out: Tensor, chunk: int,
                      chunk_grad: Callable[[Tensor, Tensor, slice], Tensor]) -> Tensor:
    """The gradient w.r.t. ``logits [M, R, V]`` (in their dtype), one chunk of rows at a time.

    For each chunk, ``chunk_grad(logp, g, rows)`` gets ``logp`` = log softmax(s z) ``[n, V]`` (a fresh working-dtype
    tensor it may modify in place), ``g`` = the incoming gradient times s = 1 / tau ``[n, 1]`` (the chain rule through
    s z) and the chunk's ``rows``, and returns the chunk's ``[n, V]`` gradient.
    """
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [M, R, V], dtype of logits
    flat_grad = grad.view(-1, logits.shape[-1])  # [N, V]
    n_rows = lse.shape[0]
    for start in range(0, n_rows, chunk):
        rows = slice(start, min(start + chunk, n_rows))
        g = grad_out[rows].to(lse.dtype)  # [n]
        if inv is not None:
            g = g * inv[rows]  # g / tau
        logp = _load(logits, rows.start, rows.stop, lse.dtype, inv, writable=True)  # [n, V], s z
        logp.sub_(lse[rows].unsqueeze(-1))  # log softmax(s z)
        flat_grad[rows] = chunk_grad(logp, g.unsqueeze(-1), rows)
        del logp  # free the chunk before the next one is loaded
    return grad


class _LogSoftmaxGather(torch.autograd.Function):
    """log p(y) = s z_y - logsumexp(s z), s = 1 / tau, chunked over rows; d/dz_j = g s (1[j = y] - softmax(s z)_j)."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, inv: Tensor | None, chunk: int) -> Tensor:
        # logits [M, R, V] (N = M * R rows), labels [M, R], inv [N] or None
        work = _work_dtype(logits.dtype)
        n_rows = labels.numel()
        lse = torch.empty(n_rows, dtype=work, device=logits.device)  # [N]
        for start in range(0, n_rows, chunk):
            stop = min(start + chunk, n_rows)
            lse[start:stop] = torch.logsumexp(_load(logits, start, stop, work, inv), dim=-1)
        label_logit = logits.gather(-1, labels.unsqueeze(-1)).reshape(-1).to(work)  # [N]
        if inv is not None:
            label_logit = label_logit * inv
        ctx.save_for_backward(logits, labels, inv, lse)
        ctx.chunk = chunk
        return label_logit - lse  # [N]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # grad_out [N]
        logits, labels, inv, lse = ctx.saved_tensors
        flat_labels = labels.reshape(-1, 1)  # [N, 1]

        def chunk_grad(logp: Tensor, g: Tensor, rows: slice) -> Tensor:  # g / tau * (onehot - p)
            return logp.exp_().mul_(-g).scatter_add_(-1, flat_labels[rows], g)

        return _chunked_backward(logits, inv, lse, grad_out, ctx.chunk, chunk_grad), None, None, None


class _Entropy(torch.autograd.Function):
    """H = logsumexp(s z) - sum_j p_j s z_j, p = softmax(s z), s = 1 / tau, chunked over rows;
    dH/dz_j = -g s p_j (log p_j + H)."""

    @staticmethod
    def forward(ctx, logits: Tensor, inv: Tensor | None, chunk: int) -> Tensor:  # logits [M, R, V], inv [N] or None
        work = _work_dtype(logits.dtype)
        n_rows = logits.shape[0] * logits.shape[1]
        lse = torch.empty(n_rows, dtype=work, device=logits.device)  # [N]
        entropy = torch.empty_like(lse)  # [N]
        for start in range(0, n_rows, chunk):
            stop = min(start + chunk, n_rows)
            z = _load(logits, start, stop, work, inv)  # [n, V], scaled
            lse_c = torch.logsumexp(z, dim=-1)  # [n]
            probs = torch.softmax(z, dim=-1)  # [n, V]
            lse[start:stop] = lse_c
            entropy[start:stop] = lse_c - probs.mul_(z).sum(-1)
            del z, probs  # free the chunk before the next one is loaded
        ctx.save_for_backward(logits, inv, lse, entropy)
        ctx.chunk = chunk
        return entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # grad_out [N]
        logits, inv, lse, entropy = ctx.saved_tensors

        def chunk_grad(logp: Tensor, g: Tensor, rows: slice) -> Tensor:  # -g / tau * p * (log p + H)
            return logp.exp().mul_(logp.add_(entropy[rows].unsqueeze(-1))).mul_(-g)

        return _chunked_backward(logits, inv, lse, grad_out, ctx.chunk, chunk_grad), None, None


def _inverse_temperature(temperature: object, logits: Tensor) -> Tensor | None:
    """Validate ``temperature`` against ``logits [..., V]``; return 1 / tau per flattened row ``[N]`` (None for 1).

    Accepted: None, a positive finite float, or a floating tensor of positive finite values whose shape is a prefix
    of ``logits.shape[:-1]`` (``[B]``, ``[B, T]`` or 0-dim for ``[B, T, V]``), on the device of ``logits``. The
    values of a tensor are checked on the host (one synchronisation). 1 / tau is computed in the working dtype.
    """
    if temperature is None:
        return None
    lead = logits.shape[:-1]
    work = _work_dtype(logits.dtype)
    if isinstance(temperature, Tensor):
        if not temperature.is_floating_point():
            raise ValueError(f"temperature must be a floating-point tensor, got dtype {temperature.dtype}")
        if temperature.device != logits.device:
            raise ValueError(f"temperature is on {temperature.device} but logits is on {logits.device}")
        if temperature.dim() > len(lead) or temperature.shape != lead[:temperature.dim()]:
            raise ValueError(
                f"temperature must be 0-dim or have a prefix of the leading (non-vocabulary) shape of logits "
                f"{tuple(lead)}, got {tuple(temperature.shape)}")
        if not bool(((temperature > 0) & torch.isfinite(temperature)).all()):
            raise ValueError("temperature must be > 0 and finite everywhere")
        tau = temperature.detach().to(work)  # [B], [B, T] or []
    elif isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        value = check_positive(temperature, "temperature")
        if value == 1.0:
            return None
        tau = torch.tensor(value, dtype=work, device=logits.device)  # []
    else:
        raise ValueError(f"temperature must be None, a float or a tensor, got {type(temperature).__name__}")
    inv = torch.reciprocal(tau)
    inv = inv.reshape(inv.shape + (1,) * (len(lead) - inv.dim()))  # [B, 1] for [B], ...
    return inv.expand(lead).reshape(-1)  # [N]


def logprobs_from_logits(logits: Tensor, labels: Tensor, *, temperature: float | Tensor | None = None,
                         chunk_rows: int | None = None) -> Tensor:
    """Log-probability of each label under the softmax of its logits divided by the sampling temperature.

    Formula: logp[b, t] = z_y / tau - logsumexp_v (z_v / tau), with z = logits[b, t], y = labels[b, t] and tau the
    temperature of row b (or position (b, t)); tau = 1 without a temperature.
    Reference: the standard per-token log-likelihood (e.g. TRL's ``selective_log_softmax``, which also avoids the
    full log-softmax) of the tempered sampling distribution softmax(z / tau) that vLLM samples from; here the memory
    bound is explicit, see the module docstring.

    ``logits`` is ``[..., V]`` and ``labels`` ``[...]`` (typically ``[B, T, V]`` and ``[B, T]``); the result has the
    shape of ``labels``, float32 (float64 for float64 logits). ``logits`` may be a non-contiguous view (a 3-D one is
    read without a copy). ``temperature`` is None, a positive float, or a floating tensor of positive values shaped
    like a prefix of ``labels``: ``[B]`` (one per rollout), ``[B, T]`` or 0-dim, broadcast over the remaining dims;
    1 / tau is applied to each float32 chunk inside the kernel, so ``logits.float() / tau`` is never materialised.
    ``chunk_rows`` bounds how many flattened rows are upcast to float32 at once (default: as many as fit in 2**25
    elements). Differentiable with respect to ``logits`` (first order); the temperature gets no gradient.
    """
    logits = check_float(logits, "logits")
    labels = check_tensor(labels, "labels")
    if logits.dim() < 1 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have the shape of logits without its last (vocabulary) dimension "
            f"{tuple(logits.shape[:-1])}, got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if labels.device != logits.device:
        raise ValueError(f"labels is on {labels.device} but logits is on {logits.device}")
    inv = _inverse_temperature(temperature, logits)  # [N] or None
    chunk = _rows_per_chunk(chunk_rows, logits.shape[-1])
    rows = _rows_view(logits)  # [M, R, V], M * R = N; a view
    out = _LogSoftmaxGather.apply(rows, labels.reshape(rows.shape[:-1]).long(), inv, chunk)  # [N]
    return out.view(labels.shape)  # [B, T]


def entropy_from_logits(logits: Tensor, *, temperature: float | Tensor | None = None,
                        chunk_rows: int | None = None) -> Tensor:
    """Entropy of the softmax distribution of each row of logits divided by the sampling temperature.

    Formula: H[b, t] = -sum_v p_v log p_v = logsumexp(z / tau) - sum_v p_v z_v / tau, with p = softmax(z / tau),
    z = logits[b, t] and tau the temperature of row b (or position (b, t)); tau = 1 without a temperature.
    Reference: the entropy bonus/diagnostic of PPO (Schulman et al. 2017, "Proximal Policy Optimization Algorithms").

    ``logits`` is ``[..., V]``; the result is ``[...]`` (``[B, T]``), float32 (float64 for float64 logits).
    ``temperature`` as in :func:`logprobs_from_logits` (``[B]``, ``[B, T]``, 0-dim tensor or float).
    Chunked like :func:`logprobs_from_logits`, with the same memory bound; differentiable with respect to
    ``logits`` (first order).
    """
    logits = check_float(logits, "logits")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one (vocabulary) dimension")
    inv = _inverse_temperature(temperature, logits)  # [N] or None
    chunk = _rows_per_chunk(chunk_rows, logits.shape[-1])
    out = _Entropy.apply(_rows_view(logits), inv, chunk)  # [N]
    return out.view(logits.shape[:-1])  # [B, T]
