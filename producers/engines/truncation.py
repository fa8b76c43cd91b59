"""The distribution a token is sampled from under temperature, min-p, top-k and top-p, as vLLM builds it.

Consumes: next-token logits ``[N, V]`` and a :class:`~producers.engines.base.Sampling`.
Produces: :func:`truncated_logprobs` ``[N, V]``: the log-probabilities of the distribution actually sampled from,
``-inf`` on every token the truncation removed; the ``hf`` engine draws from it and reports its values as behaviour
logprobs, and they equal what vLLM returns with ``logprobs_mode="processed_logprobs"``.
Guarantees: pure (the input is not modified), float32 out; with no truncation (``top_k`` 0 or -1, ``top_p`` 1,
``min_p`` 0) the result is exactly ``log_softmax(logits / T)``, the operations the engine always ran.

The order and the rules are vLLM 0.32's (``vllm/v1/sample/sampler.py``, ``Sampler.sample``: temperature, then the
argmax-invariant logits processors, i.e. ``MinPLogitsProcessor.apply`` in
``vllm/v1/sample/logits_processor/builtin.py``, then ``TopKTopPSampler``, whose CPU and native paths call
``apply_top_k_top_p_pytorch`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``; with ``processed_logprobs`` the
returned logprobs are ``log_softmax`` of the logits after all of it)::

    z      = logits / T                                                          temperature
    min-p: drop i  if  softmax(z)_i < min_p * max_j softmax(z)_j                 (min_p > 0)
    top-k: drop i  if  z_i < (k-th largest z)        (ties with the k-th value are kept; k > 0)
    top-p: over what is left, renormalised, sorted ascending with cumulative mass c:
           drop i  if  c_i <= 1 - top_p              (the most likely token is always kept; top_p < 1)
    logp   = log_softmax(z with dropped tokens at -inf)

So top-p sees the distribution already truncated by min-p and top-k (renormalised), and the kept set never is
empty. Note this differs from Hugging Face ``generate``'s warpers, which apply min-p last (after top-p).
"""

from __future__ import annotations

import torch
from torch import Tensor

from producers.engines.base import Sampling


def min_p_mask(z: Tensor, min_p: float) -> Tensor:
    """``[N, V]`` bool, True where ``softmax(z)_i < min_p * max softmax(z)`` (tokens min-p drops)."""
    probs = torch.softmax(z, dim=-1)  # [N, V]
    return probs < probs.amax(dim=-1, keepdim=True) * min_p


def top_k_top_p(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """``z`` ``[N, V]`` with the tokens top-k and then top-p drop set to -inf (vLLM's sort-based rule, above)."""
    z_sort, idx = z.sort(dim=-1, descending=False)  # [N, V], ascending
    if top_k > 0 and top_k < z.shape[-1]:
        kth = z_sort[:, z.shape[-1] - top_k].unsqueeze(1)  # [N, 1]: the k-th largest value
        z_sort = z_sort.masked_fill(z_sort < kth, float("-inf"))
    if top_p < 1.0:
        mass = torch.softmax(z_sort, dim=-1).cumsum(dim=-1)  # [N, V], ascending cumulative mass
        drop = mass <= 1.0 - top_p
        drop[:, -1] = False  # the most likely token stays
        z_sort = z_sort.masked_fill(drop, float("-inf"))
    return z_sort.new_empty(z_sort.shape).scatter_(-1, idx, z_sort)


def truncated_logprobs(logits: Tensor, sampling: Sampling) -> Tensor:
    """``[N, V]`` log-probabilities of the distribution sampled from (module docstring), float32."""
    z = logits.float() / sampling.temperature  # [N, V]
    if not sampling.truncates:
        return torch.log_softmax(z, dim=-1)
    if sampling.min_p > 0.0:
        z = z.masked_fill(min_p_mask(z, sampling.min_p), float("-inf"))
    if sampling.top_k > 0 or sampling.top_p < 1.0:
        z = top_k_top_p(z, sampling.top_k, sampling.top_p)
    return torch.log_softmax(z, dim=-1)
