"""logprobs_from_logits / entropy_from_logits: exactness against torch, chunk invariance, and a memory probe."""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from stream_rl.algorithms import entropy_from_logits, logprobs_from_logits


def peak_cpu_bytes(fn) -> int:
    """Peak of the bytes allocated (and not yet freed) on the CPU while ``fn()`` runs, from torch's profiler.

    With ``profile_memory=True`` every allocation and free of torch's CPU allocator is recorded on the op that made it
    (forward and backward; CPU autograd runs on the calling thread). Summing them in time order gives the live-memory
    trajectory; tensors allocated before ``fn`` (the logits themselves) are not counted. Each op's allocations are
    netted against what the op itself frees before returning, so short-lived scratch space inside one kernel call is
    not seen; everything that outlives an op (outputs, tensors saved for backward) is.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def reference_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_log_softmax_gather_on_a_large_vocabulary(dtype):
    torch.manual_seed(0)
    B, T, V = 2, 5, 50_257
    logits = (torch.randn(B, T, V) * 3).to(dtype)  # [B, T, V]
    labels = torch.randint(0, V, (B, T))  # [B, T]
    expected = reference_logprobs(logits, labels)  # [B, T], float64 on the same (rounded) logits
    for chunk_rows in (1, 7, None):
        out = logprobs_from_logits(logits, labels, chunk_rows=chunk_rows)
        assert out.shape == (B, T) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)


def test_chunk_size_does_not_change_results_or_gradients():
    """Rows are independent, so every chunking (1 row, 7 rows, all rows at once) must give bit-identical numbers."""
    torch.manual_seed(1)
    B, T, V = 3, 5, 997
    logits = torch.randn(B, T, V, dtype=torch.bfloat16)
    labels = torch.randint(0, V, (B, T))
    weights = torch.randn(B, T)
    results = []
    for chunk_rows in (1, 7, B * T):
        x = logits.clone().requires_grad_(True)
        lp = logprobs_from_logits(x, labels, chunk_rows=chunk_rows)
        ent = entropy_from_logits(x, chunk_rows=chunk_rows)
        ((lp + ent) * weights).sum().backward()
        results.append((lp.detach(), ent.detach(), x.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_gradients_match_autograd_of_log_softmax():
    torch.manual_seed(2)
    logits = torch.randn(1, 3, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (1, 3))
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, labels, chunk_rows=2), (logits,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_rows=2), (logits,))
    logits = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3))
    weights = torch.randn(2, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad((logprobs_from_logits(logits, labels) * weights).sum(), logits)
    (expected,) = torch.autograd.grad((reference_logprobs(logits, labels) * weights).sum(), logits)
    torch.testing.assert_close(grad, expected)
    (grad,) = torch.autograd.grad((entropy_from_logits(logits, chunk_rows=4) * weights).sum(), logits)
    reference_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    (expected,) = torch.autograd.grad((reference_entropy * weights).sum(), logits)
    torch.testing.assert_close(grad, expected)


def test_hand_computed_values():
    # Uniform logits over V = 4: log p = -log 4 = -1.386294, H = log 4.
    # Logits [0, log 3] over V = 2: p = [1/4, 3/4]; log p(1) = log 0.75 = -0.287682;
    # H = -(0.25 log 0.25 + 0.75 log 0.75) = 0.562335.
    uniform = torch.zeros(1, 1, 4)
    torch.testing.assert_close(logprobs_from_logits(uniform, torch.tensor([[2]])), torch.tensor([[-math.log(4)]]))
    torch.testing.assert_close(entropy_from_logits(uniform), torch.tensor([[math.log(4)]]))
    skewed = torch.tensor([[[0.0, math.log(3.0)]]])
    torch.testing.assert_close(logprobs_from_logits(skewed, torch.tensor([[1]])), torch.tensor([[math.log(0.75)]]))
    expected_h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy_from_logits(skewed), torch.tensor([[expected_h]]))


def test_entropy_matches_the_definition():
    torch.manual_seed(3)
    logits = torch.randn(2, 4, 1000, dtype=torch.bfloat16) * 4
    p = torch.softmax(logits.double(), -1)
    expected = -(p * torch.log(p)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_rows=3).double(), expected, rtol=0, atol=1e-4)


MEM_B, MEM_T, MEM_V, MEM_CHUNK = 4, 8, 4096, 3


def memory_case():
    torch.manual_seed(4)
    logits = torch.randn(MEM_B, MEM_T, MEM_V, dtype=torch.bfloat16, requires_grad=True)
    return logits, torch.randint(0, MEM_V, (MEM_B, MEM_T))


def forward_backward_peak(logprob_fn) -> int:
    logits, labels = memory_case()
    return peak_cpu_bytes(lambda: logprob_fn(logits, labels).sum().backward())


def budget_bytes() -> int:
    """The bf16 gradient w.r.t. the logits (unavoidable: B*T*V*2 bytes) plus four float32 chunks of MEM_CHUNK rows."""
    return MEM_B * MEM_T * MEM_V * 2 + 4 * MEM_CHUNK * MEM_V * 4


def test_no_float32_copy_of_the_full_logits_forward_or_backward():
    """Peak live CPU memory of forward + backward stays within the bf16 gradient plus a few float32 chunks.

    This can fail: a float32 copy of the logits alone is B*T*V*4 bytes = 2x the gradient, far over the budget;
    ``test_the_memory_probe_catches_full_float32_copies`` runs two such implementations through the same probe
    (the obvious ``log_softmax(logits.float())`` and a chunked forward left to plain autograd, which keeps every
    float32 chunk alive for the backward pass) and sees both exceed it. The lower bound guards against a probe that
    sees nothing (it must at least see the gradient).
    """
    grad_bytes = MEM_B * MEM_T * MEM_V * 2
    peak = forward_backward_peak(lambda x, y: logprobs_from_logits(x, y, chunk_rows=MEM_CHUNK))
    assert grad_bytes <= peak <= budget_bytes()
    peak = forward_backward_peak(lambda x, y: entropy_from_logits(x, chunk_rows=MEM_CHUNK))
    assert grad_bytes <= peak <= budget_bytes()


def naive_logprobs(logits, labels):
    return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def chunked_forward_plain_autograd(logits, labels):
    rows, flat_labels = logits.reshape(-1, MEM_V), labels.reshape(-1, 1)
    pieces = []
    for start in range(0, rows.shape[0], MEM_CHUNK):
        chunk = rows[start:start + MEM_CHUNK].float()  # autograd saves it for logsumexp's backward
        label_logit = chunk.gather(-1, flat_labels[start:start + MEM_CHUNK]).squeeze(-1)
        pieces.append(label_logit - torch.logsumexp(chunk, -1))
    return torch.cat(pieces)


@pytest.mark.parametrize("implementation", [naive_logprobs, chunked_forward_plain_autograd])
def test_the_memory_probe_catches_full_float32_copies(implementation):
    assert forward_backward_peak(implementation) > budget_bytes()


def test_bad_arguments_raise_value_errors():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(logits, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="logits"):
        logprobs_from_logits(torch.zeros(2, 3, 5, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_rows"):
        logprobs_from_logits(logits, torch.zeros(2, 3, dtype=torch.long), chunk_rows=0)
    with pytest.raises(ValueError, match="chunk_rows"):
        entropy_from_logits(logits, chunk_rows=2.5)
