"""Memory formulas for training and serving a dense decoder, one pure function per formula, all in bytes.

Consumes: plain numbers (parameter count P, dtype names, batch and sequence sizes, architecture sizes).
Produces: byte counts (``int``); :func:`gib` converts for display.
Guarantees: every function is pure and its formula is in its docstring; ``docs/planner.md`` gives the sources and a
worked example, and ``tests/unit/test_planner.py`` checks each against hand computations, the weights, gradients,
AdamW states, autocast copies and KV cache also against tensors measured on CPU.

Symbols: P parameters, s sequence length, b micro batch (sequences), h hidden size, a attention heads, f MLP
width, L layers, V vocabulary, e bytes per element of the compute dtype, N data-parallel trainer ranks (one GPU
each).

The trainer's layout is this repo's (``consumers/trainer/engines.py``), not the ZeRO paper's: with a 16-bit
dtype the parameters stay fp32 (they are the master weights), their gradients are fp32, and ``torch.autocast``
makes 16-bit copies of the weights for compute. The paper's mixed-precision Adam keeps 16-bit parameters and
gradients instead (2P + 2P + 12P bytes); here it is 4P weights + 4P gradients + 8P moments + eP autocast copies,
and DeepSpeed's ZeRO optimizer adds an fp32 copy of each rank's partition (4P / N).

Sources:
- ZeRO partitioning: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models" (stage 1 shards the optimizer states, stage 2 also the gradients, stage 3 also the parameters).
- DeepSpeed 0.19's ``zero/stage_1_and_2.py`` and ``zero/stage3.py``: the fp32 partition each rank's optimizer
  updates is a clone (``.clone()`` at stages 1-2; at stage 3 the "already fp32" shortcut compares a
  ``torch.device`` with a string and never fires), so it exists even for an fp32 module.
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.1:
  ``s*b*h*(34 + 5*a*s/h)`` bytes per layer at 16 bits for a GPT layer (MLP width 4h, dropout, no parallelism).
  :func:`activation_bytes_per_layer` keeps their accounting term by term but generalises it to GQA, gated (SwiGLU)
  MLPs, no dropout and fused (flash) attention; with GPT settings it reduces to their formula exactly.
"""

from __future__ import annotations

import math
from types import MappingProxyType

DTYPE_BYTES = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2})
DTYPE_ALIASES = MappingProxyType({"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                                  "float": "fp32"})
OPTIMIZER_STATES = MappingProxyType({"adamw": 2, "sgd": 1})  # fp32 tensors of P elements each
ZERO_SHARDED_FROM = MappingProxyType({"optimizer": 1, "master_copy": 1, "gradients": 2, "weights": 3})
FP32_BYTES = 4
GIB = 1024**3


def canonical_dtype(dtype: str) -> str:
    """``"bfloat16"`` -> ``"bf16"`` etc.; ValueError for anything not in :data:`DTYPE_BYTES`."""
    name = DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPE_BYTES)})")
    return name


def dtype_bytes(dtype: str) -> int:
    """Bytes per element: fp32 4, bf16 and fp16 2."""
    return DTYPE_BYTES[canonical_dtype(dtype)]


def weights_bytes(params: int, dtype: str) -> int:
    """Model weights: ``P * bytes(dtype)``."""
    return params * dtype_bytes(dtype)


def trained_param_dtype(dtype: str, master_weights: bool) -> str:
    """The dtype the trainer keeps its parameters (and so their gradients) in: fp32 with master weights, else ``dtype``.

    Mixed precision as this repo's trainer does it (``trainer.dtype=bfloat16``): the module stays fp32 and
    ``torch.autocast`` computes in 16 bits, so the parameters are the fp32 master weights. Without master weights
    (pure 16-bit training) the parameters are 16-bit.
    """
    return "fp32" if master_weights else canonical_dtype(dtype)


def gradients_bytes(params: int, param_dtype: str) -> int:
    """Gradients, one per parameter in the parameters' dtype: ``P * bytes(param_dtype)``.

    Autograd gives each gradient its parameter's dtype, so under autocast mixed precision they are fp32 (4P), not
    16-bit (the ZeRO paper's 2P assumes 16-bit parameters). Pass :func:`trained_param_dtype`.
    """
    return params * dtype_bytes(param_dtype)


def autocast_copy_bytes(params: int, dtype: str, master_weights: bool) -> int:
    """16-bit copies of the fp32 weights that mixed precision computes with: ``P * e``, else 0.

    ``torch.autocast`` casts each weight a matmul uses to 16 bits, caches the copy until the forward's autocast
    region ends and autograd keeps it until backward has passed that layer, so all of them are alive at the end of
    the forward, whatever the ZeRO stage (at stage 3 each copy is of the gathered, full weight). An upper bound by
    ``e * (embeddings + norm weights)``, which autocast does not cast.
    """
    return params * dtype_bytes(dtype) if master_weights and canonical_dtype(dtype) != "fp32" else 0


def optimizer_bytes(params: int, optimizer: str) -> int:
    """Optimizer states: ``P * 4 * n_states``, fp32: AdamW keeps two moments (8P bytes), SGD with momentum one (4P)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r} (choose from {', '.join(OPTIMIZER_STATES)})")
    return params * FP32_BYTES * OPTIMIZER_STATES[optimizer]


def zero_master_copy_bytes(params: int, zero_stage: int) -> int:
    """DeepSpeed ZeRO's fp32 copy of the parameters its optimizer updates: ``4P`` at stages 1-3, 0 at stage 0.

    Each rank's ZeRO optimizer steps a separate fp32 copy of its partition (sharded like the optimizer states, so
    ``4P / N`` per GPU) and copies the result back into the parameters; it does so even when the parameters are
    already fp32. Stage 0 (plain torch DDP) steps the parameters themselves.
    """
    return params * FP32_BYTES if zero_stage >= 1 else 0


def flat_allreduce_bytes(gradients: int, zero_stage: int, ranks: int) -> int:
    """The torch engine's flat gradient buffer at the step: ``gradients`` at stage 0 with ``ranks > 1``, else 0.

    Plain data parallelism here sums every gradient in one ``torch.cat`` of them (``Ranks.all_reduce_grads``): for
    the step, one more copy of all gradients. ZeRO reduces in fixed-size buckets instead (not counted).
    """
    return gradients if zero_stage == 0 and ranks > 1 else 0


def zero_shard_bytes(total: int, kind: str, zero_stage: int, gpus: int) -> int:
    """Per-GPU share of ``kind`` under ZeRO over ``gpus`` ranks: ``ceil(total / N)`` or ``total``.

    ``kind`` ("weights", "gradients", "optimizer" or "master_copy") is partitioned over the N data-parallel GPUs
    when ``zero_stage >= ZERO_SHARDED_FROM[kind]`` (optimizer states and the master copy from stage 1, gradients
    from 2, weights from 3); otherwise every GPU holds all of it (stage 0 = plain DDP).
    """
    if not 0 <= zero_stage <= 3:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    return -(-total // gpus) if zero_stage >= ZERO_SHARDED_FROM[kind] else total


def attention_activation_bytes(s: int, b: int, h: int, q_dim: int, kv_dim: int, heads: int, *,
                               flash_attention: bool, dropout: bool, e: int) -> int:
    """Tensors one attention block keeps for backward (Korthikanti et al. 2022, sec. 4.1, generalised).

    ``e*s*b*(h + 2*q_dim + 2*kv_dim)``: the QKV input (h), Q and the output-projection input (q_dim each), K and V
    (kv_dim each; kv_dim < q_dim under GQA); ``+ s*b*h`` for a 1-byte dropout mask after the projection; and
    without fused attention the softmax output ``e*a*s^2*b`` (plus its mask ``a*s^2*b`` and dropped-out copy
    ``e*a*s^2*b`` with dropout). Fused (flash) attention recomputes the scores: no s^2 term (its per-row fp32
    log-sum-exp, ``4*a*s*b``, is left out). With e=2, q_dim=kv_dim=h and dropout: ``11*s*b*h + 5*a*s^2*b``.
    """
    mask = 1 if dropout else 0
    linear = e * s * b * (h + 2 * q_dim + 2 * kv_dim) + mask * s * b * h
    scores = 0 if flash_attention else heads * s * s * b * (e + (mask + e) * mask)
    return linear + scores


def mlp_activation_bytes(s: int, b: int, h: int, f: int, *, gated: bool, dropout: bool, e: int) -> int:
    """Tensors one MLP block keeps for backward (Korthikanti et al. 2022, sec. 4.1, generalised).

    Plain (GPT-2: fc, GeLU, proj): ``e*s*b*(h + 2f)``, the fc input and the activation's input and output.
    Gated (SwiGLU: down(silu(gate(x)) * up(x))): ``e*s*b*(h + 4f)``: the input, gate(x), up(x), silu(gate(x)) and
    the product. ``+ s*b*h`` for a 1-byte dropout mask. With e=2, f=4h, plain, dropout: ``19*s*b*h``.
    """
    return e * s * b * (h + (4 if gated else 2) * f) + (s * b * h if dropout else 0)


def activation_bytes_per_layer(s: int, b: int, h: int, q_dim: int, kv_dim: int, heads: int, f: int, *,
                               gated: bool, flash_attention: bool, dropout: bool = False, e: int = 2) -> int:
    """One decoder layer's saved activations: two norm inputs ``2*e*s*b*h`` + attention + MLP (above).

    GPT settings (e=2, q_dim=kv_dim=h, f=4h, plain MLP, dropout, unfused attention) give Korthikanti et al.'s
    ``s*b*h*(34 + 5*a*s/h)``; with fused attention, ``34*s*b*h``. Llama-3-8B (GQA kv_dim=h/4, SwiGLU f=3.5h, no
    dropout, flash) gives ``4 + 7 + 30 = 41*s*b*h``.
    """
    norms = 2 * e * s * b * h
    attention = attention_activation_bytes(s, b, h, q_dim, kv_dim, heads, flash_attention=flash_attention,
                                           dropout=dropout, e=e)
    return norms + attention + mlp_activation_bytes(s, b, h, f, gated=gated, dropout=dropout, e=e)


def korthikanti_layer_bytes(s: int, b: int, h: int, heads: int) -> float:
    """The published formula, for reference and tests: ``s*b*h*(34 + 5*a*s/h)`` bytes (16-bit GPT layer)."""
    return s * b * h * (34 + 5 * heads * s / h)


def activations_bytes(layers: int, per_layer: int, layer_input: int, checkpointing: bool) -> int:
    """All layers' activations: ``L * per_layer``; with full checkpointing ``L * layer_input + per_layer``.

    Full (per-layer) recomputation keeps only each layer's input (``layer_input = e*s*b*h``) and, while one layer
    is recomputed in backward, that layer's full activations (Korthikanti et al. 2022, sec. 4.2: ``2*s*b*h*L``).
    """
    return layers * layer_input + per_layer if checkpointing else layers * per_layer


def micro_batch_rows(seq_len: int, micro_batch: int, max_tokens: int | None) -> int:
    """Sequences of length ``seq_len`` that bound a micro batch's activations: ``micro_batch``, or with a token
    budget C (``trainer.max_tokens_per_micro_batch``) ``min(micro_batch, ceil(max(C, s) / s))``.

    A token-filled micro batch holds at most C tokens, or one sequence when a sequence alone is longer (it is never
    split), so its tokens are at most ``max(C, s)``; as ``ceil(max(C, s) / s)`` sequences of the longest length s
    this bounds both the linear terms (``s*b``) and, since no sequence is longer than s, the attention terms
    (``s^2*b``) of :func:`activation_bytes_per_layer`. E.g. s = 1536, C = 4096: 3 rows instead of 4096 / 1536.
    """
    if max_tokens is None:
        return micro_batch
    return min(micro_batch, -(-max(max_tokens, seq_len) // seq_len))


def logits_bytes(b: int, s: int, vocab: int, element_bytes: int = FP32_BYTES) -> int:
    """The logits buffer: ``b * s * V * 4`` (fp32). Each extra full-vocabulary copy (log-softmax) adds as much."""
    return b * s * vocab * element_bytes


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, element_bytes: int, tokens: int) -> int:
    """KV cache: ``2 * L * kv_heads * head_dim * bytes * tokens`` (keys and values, every layer, every token).

    For generation, ``tokens = gen_batch * (prompt_len + max_new_tokens)``, the most the batch can hold at once.
    """
    return 2 * layers * kv_heads * head_dim * element_bytes * tokens


def with_headroom(total: int, headroom: float = 0.2) -> int:
    """Memory to reserve for an estimate: ``ceil(total * (1 + headroom))``, by default 20 % on top."""
    if headroom < 0:
        raise ValueError(f"headroom must be >= 0, got {headroom}")
    return math.ceil(total * (1 + headroom))


def gib(n_bytes: float) -> float:
    """Bytes in GiB (2**30)."""
    return n_bytes / GIB
