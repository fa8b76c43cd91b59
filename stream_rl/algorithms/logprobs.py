"""Per-token log-probabilities and entropies from logits, without a full-vocabulary float32 copy.

Consumes: ``logits`` ``[B, T, V]`` in any floating dtype (bf16 in training), ``labels`` ``[B, T]`` integer ids.
Produces: ``[B, T]`` in float32 (float64 for float64 logits).
Guarantees: the only tensor of ``[B, T, V]`` size ever created, forward or backward, is the gradient with respect to
``logits`` (in the dtype of ``logits``, as autograd requires). Everything computed in float32 is computed on a chunk
of at most ``chunk_rows`` flattened rows, so the extra memory is ``chunk_rows * V * 4`` bytes, not ``B * T * V * 4``.

How: flatten to N = B * T rows; gather the label logit z_y (one value per row); compute logsumexp row-chunk by
row-chunk with only the chunk upcast to float32. ``torch.log_softmax(logits.float())`` would instead allocate the
upcast input and the output, two ``[B, T, V]`` float32 tensors, and autograd would keep them for the backward pass.
The backward pass is written by hand for the same reason: it rebuilds softmax one chunk at a time from the saved
per-row logsumexp instead of keeping every chunk alive in the autograd graph.
No masking here: positions past the response are ordinary rows; multiply by the mask downstream.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_float, check_tensor

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


class _LogSoftmaxGather(torch.autograd.Function):
    """log p(y) = z_y - logsumexp(z), chunked over rows; d/dz_j = g * (1[j = y] - softmax(z)_j)."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, chunk: int) -> Tensor:  # logits [N, V], labels [N]
        work = _work_dtype(logits.dtype)
        lse = torch.empty(logits.shape[0], dtype=work, device=logits.device)  # [N]
        for start in range(0, logits.shape[0], chunk):
            lse[start:start + chunk] = torch.logsumexp(logits[start:start + chunk].to(work), dim=-1)
        label_logit = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(work)  # [N]
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk = chunk
        return label_logit - lse  # [N]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # grad_out [N]
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [N, V], dtype of logits
        for start in range(0, logits.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            g = grad_out[rows].to(lse.dtype).unsqueeze(-1)  # [n, 1]
            probs = torch.exp(logits[rows].to(lse.dtype) - lse[rows].unsqueeze(-1))  # [n, V]
            probs.mul_(-g).scatter_add_(-1, labels[rows].unsqueeze(-1), g)  # g * (onehot - p)
            grad[rows] = probs
        return grad, None, None


class _Entropy(torch.autograd.Function):
    """H = logsumexp(z) - sum_j p_j z_j, chunked over rows; dH/dz_j = -g * p_j * (log p_j + H)."""

    @staticmethod
    def forward(ctx, logits: Tensor, chunk: int) -> Tensor:  # logits [N, V]
        work = _work_dtype(logits.dtype)
        lse = torch.empty(logits.shape[0], dtype=work, device=logits.device)  # [N]
        entropy = torch.empty_like(lse)  # [N]
        for start in range(0, logits.shape[0], chunk):
            z = logits[start:start + chunk].to(work)  # [n, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [n]
            probs = torch.softmax(z, dim=-1)  # [n, V]
            lse[start:start + chunk] = lse_c
            entropy[start:start + chunk] = lse_c - (probs * z).sum(-1)
        ctx.save_for_backward(logits, lse, entropy)
        ctx.chunk = chunk
        return entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # grad_out [N]
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [N, V], dtype of logits
        for start in range(0, logits.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logp = logits[rows].to(lse.dtype) - lse[rows].unsqueeze(-1)  # [n, V]
            weight = logp.exp().mul_(logp.add_(entropy[rows].unsqueeze(-1)))  # p * (log p + H)
            grad[rows] = weight.mul_(-grad_out[rows].to(lse.dtype).unsqueeze(-1))
        return grad, None


def logprobs_from_logits(logits: Tensor, labels: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """Log-probability of each label under the softmax of its logits.

    Formula: logp[b, t] = logits[b, t, y] - logsumexp_v logits[b, t, v], with y = labels[b, t].
    Reference: the standard per-token log-likelihood (e.g. TRL's ``selective_log_softmax``, which also avoids the
    full log-softmax); here the memory bound is explicit, see the module docstring.

    ``logits`` is ``[..., V]`` and ``labels`` ``[...]`` (typically ``[B, T, V]`` and ``[B, T]``); the result has the
    shape of ``labels``. ``chunk_rows`` bounds how many flattened rows are upcast to float32 at once (default: as many
    as fit in 2**25 elements). Differentiable with respect to ``logits`` (first order).
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
    vocab = logits.shape[-1]
    chunk = _rows_per_chunk(chunk_rows, vocab)
    flat = logits.reshape(-1, vocab)  # [N, V] (a view when logits is contiguous)
    out = _LogSoftmaxGather.apply(flat, labels.reshape(-1).long(), chunk)  # [N]
    return out.view(labels.shape)  # [B, T]


def entropy_from_logits(logits: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """Entropy of the softmax distribution of each row of logits.

    Formula: H[b, t] = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v, with p = softmax(z), z = logits[b, t].
    Reference: the entropy bonus/diagnostic of PPO (Schulman et al. 2017, "Proximal Policy Optimization Algorithms").

    ``logits`` is ``[..., V]``; the result is ``[...]`` (``[B, T]``), float32 (float64 for float64 logits).
    Chunked like :func:`logprobs_from_logits`; differentiable with respect to ``logits`` (first order).
    """
    logits = check_float(logits, "logits")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one (vocabulary) dimension")
    vocab = logits.shape[-1]
    chunk = _rows_per_chunk(chunk_rows, vocab)
    out = _Entropy.apply(logits.reshape(-1, vocab), chunk)  # [N]
    return out.view(logits.shape[:-1])  # [B, T]
