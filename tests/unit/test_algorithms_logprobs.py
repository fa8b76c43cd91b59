"""logprobs_from_logits / entropy_from_logits: exactness against torch, chunk invariance, and a memory probe."""

from __future__ import annotations

import math

import pytest
import torch
from support.memory_probe import peak_cpu_bytes

from stream_rl.algorithms import entropy_from_logits, logprobs_from_logits


def reference_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def per_row(tau: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``tau`` ``[B]`` or ``[B, T]`` as a float64 tensor broadcastable against ``logits`` ``[B, T, V]``."""
    tau = tau.double()
    return tau.reshape(tau.shape + (1,) * (logits.dim() - tau.dim()))


def reference_tempered_logprobs(logits, labels, tau):
    """float64 log_softmax(z / tau) gathered at the labels, tau ``[B]`` or ``[B, T]``."""
    return reference_logprobs(logits.double() / per_row(tau, logits), labels)


def reference_tempered_entropy(logits, tau):
    """float64 -sum_v p_v log p_v with p = softmax(z / tau)."""
    z = logits.double() / per_row(tau, logits)
    return -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)


def large_vocab_case(seed: int, B: int, dtype: torch.dtype, T: int = 5,
                     V: int = 50_257) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits ``[B, T, V]`` (scale 3, in ``dtype``) and labels ``[B, T]`` on a GPT-2-sized vocabulary."""
    torch.manual_seed(seed)
    logits = (torch.randn(B, T, V) * 3).to(dtype)  # [B, T, V]
    return logits, torch.randint(0, V, (B, T))  # [B, T]


def assert_every_chunking_matches(logits: torch.Tensor, labels: torch.Tensor, expected: torch.Tensor, **kw) -> None:
    """``logprobs_from_logits`` at chunk sizes 1, 7 and all rows: float32 ``[B, T]``, within 2e-5 of ``expected``."""
    for chunk_rows in (1, 7, None):
        out = logprobs_from_logits(logits, labels, chunk_rows=chunk_rows, **kw)
        assert out.shape == labels.shape and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_log_softmax_gather_on_a_large_vocabulary(dtype):
    logits, labels = large_vocab_case(0, 2, dtype)
    expected = reference_logprobs(logits, labels)  # [B, T], float64 on the same (rounded) logits
    assert_every_chunking_matches(logits, labels, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_temperature_gives_each_row_its_own_tempered_log_softmax(dtype):
    """Rows at tau = 0.7, 1.0, 1.3 (the trainer's mixed batch): each row is log_softmax(z / tau_row), in float64."""
    logits, labels = large_vocab_case(10, 3, dtype)
    B, T = labels.shape
    tau = torch.tensor([0.7, 1.0, 1.3])  # [B]
    expected = reference_tempered_logprobs(logits, labels, tau)  # [B, T]
    # The temperature matters: ignoring it would be off by far more than the tolerance on the rows at tau != 1.
    assert (expected - reference_logprobs(logits, labels)).abs()[[0, 2]].min() > 1e-2
    assert_every_chunking_matches(logits, labels, expected, temperature=tau)
    # Entropy on the vocabulary size of test_entropy_matches_the_definition: torch's float32 CPU softmax is only
    # accurate to ~1e-5 relative, which over 50k entries puts the float32 entropy itself ~1e-4 off.
    logits = (torch.randn(B, T, 1000) * 4).to(dtype)  # [B, T, V]
    expected_entropy = reference_tempered_entropy(logits, tau)  # [B, T]
    assert (expected_entropy - reference_tempered_entropy(logits, torch.ones(B))).abs()[[0, 2]].min() > 1e-2
    for chunk_rows in (1, 7, None):
        ent = entropy_from_logits(logits, temperature=tau, chunk_rows=chunk_rows)
        assert ent.shape == (B, T) and ent.dtype == torch.float32
        torch.testing.assert_close(ent.double(), expected_entropy, rtol=0, atol=1e-4)


def test_per_position_temperature_matches_the_reference():
    """A ``[B, T]`` temperature scales each position by its own tau."""
    torch.manual_seed(11)
    B, T, V = 2, 6, 1000
    logits = torch.randn(B, T, V, dtype=torch.bfloat16) * 4
    labels = torch.randint(0, V, (B, T))
    tau = torch.rand(B, T) * 1.5 + 0.25  # [B, T] in [0.25, 1.75)
    out = logprobs_from_logits(logits, labels, temperature=tau, chunk_rows=4)
    torch.testing.assert_close(out.double(), reference_tempered_logprobs(logits, labels, tau), rtol=0, atol=2e-5)
    ent = entropy_from_logits(logits, temperature=tau, chunk_rows=4)
    torch.testing.assert_close(ent.double(), reference_tempered_entropy(logits, tau), rtol=0, atol=1e-4)


def test_temperature_forms_that_mean_the_same_give_the_same_numbers():
    """``[B, T]`` constant along T, ``[B]``, a float, a 0-dim tensor: one 1 / tau per row, bit-identical results;
    and tau = 1 in any form is bit-identical to no temperature, gradients included."""
    torch.manual_seed(12)
    B, T, V = 3, 4, 997
    logits = torch.randn(B, T, V, dtype=torch.bfloat16) * 3
    labels = torch.randint(0, V, (B, T))
    weights = torch.randn(B, T)

    def run(temperature):
        x = logits.clone().requires_grad_(True)
        lp = logprobs_from_logits(x, labels, temperature=temperature, chunk_rows=5)
        ent = entropy_from_logits(x, temperature=temperature, chunk_rows=5)
        ((lp + ent) * weights).sum().backward()
        return lp.detach(), ent.detach(), x.grad

    def assert_same(a, b):
        for u, v in zip(a, b):
            assert torch.equal(u, v)

    tau = torch.tensor([0.7, 1.0, 1.3])  # [B]
    per_row_result = run(tau)
    torch.testing.assert_close(per_row_result[0].double(), reference_tempered_logprobs(logits, labels, tau),
                               rtol=0, atol=2e-5)
    assert_same(per_row_result, run(tau[:, None].expand(B, T)))  # [B, T]
    assert_same(per_row_result, run(tau.double()))  # a float64 tensor is rounded to float32 first
    shared = run(0.7)
    torch.testing.assert_close(shared[0].double(), reference_tempered_logprobs(logits, labels, torch.full((B,), 0.7)),
                               rtol=0, atol=2e-5)
    assert_same(shared, run(torch.full((B,), 0.7)))
    assert_same(shared, run(torch.tensor(0.7)))  # 0-dim
    plain = run(None)
    assert_same(plain, run(1.0))
    assert_same(plain, run(torch.ones(B)))
    assert_same(plain, run(torch.ones(B, T)))
    assert not torch.equal(plain[0], shared[0])


def test_non_contiguous_logits_with_a_temperature_match_the_reference():
    """The trainer's ``out.logits[:, -keep:-1]`` is a non-contiguous ``[B, T, V]`` view; chunks straddle rows."""
    torch.manual_seed(13)
    B, K, V = 3, 7, 301
    full = torch.randn(B, K, V, dtype=torch.float64, requires_grad=True)  # [B, K, V]
    labels = torch.randint(0, V, (B, K - 2))
    tau = torch.tensor([0.7, 1.0, 1.3], dtype=torch.float64)
    weights = torch.randn(B, K - 2, dtype=torch.float64)
    x = full[:, 1:-1]  # [B, T, V], T = K - 2
    assert not x.is_contiguous()
    expected = reference_tempered_logprobs(x, labels, tau)
    expected_entropy = reference_tempered_entropy(x, tau)
    (expected_grad,) = torch.autograd.grad(((expected + expected_entropy) * weights).sum(), full)
    for chunk_rows in (1, 2, 4, 7, 64):  # within a row, straddling two rows, spanning whole rows
        lp = logprobs_from_logits(x, labels, temperature=tau, chunk_rows=chunk_rows)
        ent = entropy_from_logits(x, temperature=tau, chunk_rows=chunk_rows)
        torch.testing.assert_close(lp, expected)
        torch.testing.assert_close(ent, expected_entropy)
        (grad,) = torch.autograd.grad(((lp + ent) * weights).sum(), full)
        torch.testing.assert_close(grad, expected_grad)
        assert grad[:, [0, -1]].abs().max() == 0  # positions outside the slice get no gradient
    # A 4-D slice whose leading dims cannot be merged (the one case flattened by a copy, in the logits' dtype).
    full = torch.randn(2, 3, 4, 101, dtype=torch.float64)
    x, tau = full[:, 1:], torch.tensor([0.5, 2.0], dtype=torch.float64)  # [2, 2, 4, 101], tau [2]
    labels = torch.randint(0, 101, x.shape[:-1])
    expected = torch.log_softmax(x / tau[:, None, None, None], -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(logprobs_from_logits(x, labels, temperature=tau, chunk_rows=3), expected)


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


def test_gradients_with_a_per_row_temperature_match_autograd_of_the_reference():
    """d logp / dz = (onehot - p) / tau and dH / dz = -p (log p + H) / tau, p = softmax(z / tau), per row."""
    torch.manual_seed(5)
    tau = torch.tensor([0.7, 1.3], dtype=torch.float64)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(
        lambda z: logprobs_from_logits(z, labels, temperature=tau, chunk_rows=2), (logits,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, temperature=tau, chunk_rows=2), (logits,))
    B, T, V = 3, 4, 11
    tau = torch.tensor([0.7, 1.0, 1.3], dtype=torch.float64, requires_grad=True)  # a constant to the kernel
    logits = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    weights = torch.randn(B, T, dtype=torch.float64)
    for chunk_rows in (1, 5, None):
        (grad,) = torch.autograd.grad(
            (logprobs_from_logits(logits, labels, temperature=tau, chunk_rows=chunk_rows) * weights).sum(), logits)
        reference = reference_tempered_logprobs(logits, labels, tau.detach())
        (expected,) = torch.autograd.grad((reference * weights).sum(), logits)
        torch.testing.assert_close(grad, expected)
        (grad,) = torch.autograd.grad(
            (entropy_from_logits(logits, temperature=tau, chunk_rows=chunk_rows) * weights).sum(), logits)
        (expected,) = torch.autograd.grad((reference_tempered_entropy(logits, tau.detach()) * weights).sum(), logits)
        torch.testing.assert_close(grad, expected)
    # float32 logits: the gradient is float32 and still matches the float64 reference.
    x = logits.detach().float().requires_grad_(True)
    (grad,) = torch.autograd.grad(
        (logprobs_from_logits(x, labels, temperature=tau.detach().float()) * weights.float()).sum(), x)
    assert grad.dtype == torch.float32
    (expected,) = torch.autograd.grad((reference_tempered_logprobs(logits, labels, tau.detach()) * weights).sum(),
                                      logits)
    torch.testing.assert_close(grad.double(), expected, rtol=1e-5, atol=1e-6)
    # No gradient flows to the temperature.
    logprobs_from_logits(logits, labels, temperature=tau).sum().backward()
    entropy_from_logits(logits, temperature=tau).sum().backward()
    assert tau.grad is None and logits.grad is not None


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


def memory_temperature() -> torch.Tensor:
    """One sampling temperature per row (rollout) of the memory case, ``[MEM_B]``."""
    return torch.tensor([0.7, 1.0, 1.3, 0.9])


def forward_backward_peak(logprob_fn) -> int:
    logits, labels = memory_case()
    return peak_cpu_bytes(lambda: logprob_fn(logits, labels).sum().backward())


def budget_bytes() -> int:
    """The bf16 gradient w.r.t. the logits (unavoidable: B*T*V*2 bytes) plus four float32 chunks of MEM_CHUNK rows."""
    return MEM_B * MEM_T * MEM_V * 2 + 4 * MEM_CHUNK * MEM_V * 4


@pytest.mark.parametrize("temperature", [None, "per-row"])
def test_no_float32_copy_of_the_full_logits_forward_or_backward(temperature):
    """Peak live CPU memory of forward + backward stays within the bf16 gradient plus a few float32 chunks.

    With a per-row temperature ``[MEM_B]`` too: 1 / tau is applied to each chunk inside the kernel, so the budget
    is the same. This can fail: a float32 copy of the logits alone is B*T*V*4 bytes = 2x the gradient, far over
    the budget; ``test_the_memory_probe_catches_full_float32_copies`` runs three such implementations through the
    same probe (the obvious ``log_softmax(logits.float())``, a chunked forward left to plain autograd, which keeps
    every float32 chunk alive for the backward pass, and the trainer's old ``logits.float() / tau`` before the
    kernel) and sees all exceed it. The lower bound guards against a probe that sees nothing (it must at least see
    the gradient).
    """
    tau = None if temperature is None else memory_temperature()
    grad_bytes = MEM_B * MEM_T * MEM_V * 2
    peak = forward_backward_peak(lambda x, y: logprobs_from_logits(x, y, temperature=tau, chunk_rows=MEM_CHUNK))
    assert grad_bytes <= peak <= budget_bytes()
    peak = forward_backward_peak(lambda x, y: entropy_from_logits(x, temperature=tau, chunk_rows=MEM_CHUNK))
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


def temperature_before_the_kernel(logits, labels):
    """The trainer's old call site: the scaled float32 copy of the whole logits is made before the kernel runs."""
    temperature = memory_temperature()
    return logprobs_from_logits(logits.float() / temperature[:, None, None], labels, chunk_rows=MEM_CHUNK)


@pytest.mark.parametrize("implementation",
                         [naive_logprobs, chunked_forward_plain_autograd, temperature_before_the_kernel])
def test_the_memory_probe_catches_full_float32_copies(implementation):
    assert forward_backward_peak(implementation) > budget_bytes()


def forward_budget_bytes() -> int:
    """Forward only, nothing of ``[B, T, V]`` size may be created: four float32 chunks of MEM_CHUNK rows."""
    return 4 * MEM_CHUNK * MEM_V * 4


@pytest.mark.parametrize("temperature", [None, "per-row"])
def test_a_non_contiguous_slice_of_the_logits_is_not_copied(temperature):
    """The trainer passes ``out.logits[:, -keep:-1]``, a non-contiguous view; its chunks are read in place.

    Forward only (what autograd keeps for the backward pass included, since the output is alive when ``fn``
    returns): the whole ``[B, T + 2, V]`` tensor exists before the probe starts and is not counted, the slice is a
    view and costs nothing, so the peak is a couple of float32 chunks. Copying the slice (``.contiguous()``, or the
    ``reshape(-1, V)`` the kernel used to flatten with) would cost B*T*V*2 bytes in bf16, 1.33x the budget, and the
    copy is saved for backward; the second assertion checks the probe sees it. The backward
    pass of a slice allocates the gradient of the whole tensor (autograd's, not the kernel's), so it is not probed
    here; the gradient itself is checked in test_non_contiguous_logits_with_a_temperature_match_the_reference.
    """
    tau = None if temperature is None else memory_temperature()
    torch.manual_seed(4)
    full = torch.randn(MEM_B, MEM_T + 2, MEM_V, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, MEM_V, (MEM_B, MEM_T))
    chunk_bytes = MEM_CHUNK * MEM_V * 4
    for fn in (lambda x: logprobs_from_logits(x, labels, temperature=tau, chunk_rows=MEM_CHUNK),
               lambda x: entropy_from_logits(x, temperature=tau, chunk_rows=MEM_CHUNK)):
        assert chunk_bytes <= peak_cpu_bytes(lambda: fn(full[:, 1:-1])) <= forward_budget_bytes()
        assert peak_cpu_bytes(lambda: fn(full[:, 1:-1].contiguous())) > forward_budget_bytes()


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


def test_bad_temperatures_raise_value_errors():
    B, T, V = 2, 3, 5
    logits, labels = torch.randn(B, T, V), torch.zeros(B, T, dtype=torch.long)
    bad = [0, 0.0, -0.5, float("nan"), float("inf"), True, "0.7",
           torch.tensor([0.7, 0.0]), torch.tensor([0.7, -1.0]), torch.tensor([0.7, float("nan")]),
           torch.tensor([0.7, float("inf")]),
           torch.ones(B + 1), torch.ones(B, T + 1), torch.ones(T), torch.ones(B, T, V), torch.ones(B, T, 1),
           torch.ones(B, dtype=torch.long), torch.ones(B, dtype=torch.bool), torch.ones(B, device="meta")]
    for temperature in bad:
        with pytest.raises(ValueError, match="temperature"):
            logprobs_from_logits(logits, labels, temperature=temperature)
        with pytest.raises(ValueError, match="temperature"):
            entropy_from_logits(logits, temperature=temperature)
    for good in (0.7, 2, torch.tensor(0.7), torch.full((B,), 0.7), torch.full((B, T), 0.7, dtype=torch.float16)):
        assert torch.isfinite(logprobs_from_logits(logits, labels, temperature=good)).all()
        assert torch.isfinite(entropy_from_logits(logits, temperature=good)).all()
