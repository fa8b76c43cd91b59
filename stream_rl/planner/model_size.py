"""Parameter counts of dense decoder-only transformers, from a Hugging Face ``config.json``.

Consumes: the parsed ``config.json`` of a Llama, Mistral, Qwen2, Qwen3 or GPT-2 model (a ``dict``).
Produces: a :class:`ModelShape` (the few numbers the memory formulas need) and its exact parameter count.
Guarantees: the count equals ``sum(p.numel() for p in model.parameters())`` of the corresponding transformers
model (checked in ``tests/unit/test_planner.py`` against real models built from tiny configs); Llama-3-8B comes out at
8,030,261,248. Mixture-of-experts and encoder-decoder models are rejected, not guessed.

Per decoder layer, with hidden size h, query heads a, KV heads k, head dim d, MLP width f:

- attention: q and o projections ``2 * h * a * d``, k and v projections ``2 * h * k * d`` (GQA: k < a), plus biases
  ``a*d + 2*k*d`` (q, k, v) and ``h`` (o) where the family has them, plus ``2 * d`` for Qwen3's q/k RMSNorms
- MLP: gated (SwiGLU: gate, up, down) ``3 * h * f``, plain (GPT-2: fc, proj) ``2 * h * f``, plus biases
  ``2*f + h`` (gated) or ``f + h`` (plain) where present
- norms: two per layer, ``h`` each (RMSNorm) or ``2 * h`` (LayerNorm: weight and bias)

Outside the layers: token embeddings ``V * h``, learned position embeddings ``P_max * h`` (GPT-2 only), one final
norm, and an untied lm head ``V * h`` (0 when ``tie_word_embeddings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")
GPT2_STYLE = ("gpt2",)
SUPPORTED_MODEL_TYPES = LLAMA_STYLE + GPT2_STYLE


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a dense decoder that parameter, activation and KV-cache formulas use."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    gated_mlp: bool = True
    tie_embeddings: bool = False
    layer_norm: bool = False  # LayerNorm (weight + bias) instead of RMSNorm (weight only)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys
    max_positions: int = 0  # learned absolute position embeddings (GPT-2); 0 for rotary models
    model_type: str = "llama"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_kv_heads})")


def _norm_params(shape: ModelShape, width: int) -> int:
    """One norm over ``width`` features: weight (RMSNorm) or weight + bias (LayerNorm)."""
    return 2 * width if shape.layer_norm else width


def attention_params(shape: ModelShape) -> int:
    """q, k, v, o projections of one layer: ``2*h*a*d + 2*h*k*d`` + biases + Qwen3 q/k norms (module doc)."""
    h, q_dim, kv_dim = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    weights = 2 * h * q_dim + 2 * h * kv_dim
    biases = (q_dim + 2 * kv_dim if shape.qkv_bias else 0) + (h if shape.o_bias else 0)
    qk_norms = 2 * shape.head_dim if shape.qk_norm else 0
    return weights + biases + qk_norms


def mlp_params(shape: ModelShape) -> int:
    """One layer's MLP: gated ``3*h*f (+ 2f + h)``, plain ``2*h*f (+ f + h)``; biases only with ``mlp_bias``."""
    h, f = shape.hidden_size, shape.intermediate_size
    if shape.gated_mlp:
        return 3 * h * f + (2 * f + h if shape.mlp_bias else 0)
    return 2 * h * f + (f + h if shape.mlp_bias else 0)


def layer_params(shape: ModelShape) -> int:
    """One decoder layer: attention + MLP + two norms over h."""
    return attention_params(shape) + mlp_params(shape) + 2 * _norm_params(shape, shape.hidden_size)


def embedding_params(shape: ModelShape) -> int:
    """Token embeddings ``V*h`` + learned positions ``P_max*h`` + untied lm head ``V*h`` (0 when tied)."""
    tokens = shape.vocab_size * shape.hidden_size
    positions = shape.max_positions * shape.hidden_size
    lm_head = 0 if shape.tie_embeddings else shape.vocab_size * shape.hidden_size
    return tokens + positions + lm_head


def count_params(shape: ModelShape) -> int:
    """Total parameters: ``L * layer + embeddings (+ lm head) + final norm``."""
    return (shape.num_layers * layer_params(shape) + embedding_params(shape)
            + _norm_params(shape, shape.hidden_size))


def _require(config: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` present in ``config``; a ValueError naming the key when none is."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise ValueError(f"config.json has no {keys[0]!r}")


def _llama_style(config: dict[str, Any], model_type: str) -> ModelShape:
    hidden, heads = int(_require(config, "hidden_size")), int(_require(config, "num_attention_heads"))
    attention_bias = bool(config.get("attention_bias", False))
    return ModelShape(
        vocab_size=int(_require(config, "vocab_size")), hidden_size=hidden,
        num_layers=int(_require(config, "num_hidden_layers")), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(config, "intermediate_size")), gated_mlp=True,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or model_type == "qwen2", o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)), qk_norm=model_type == "qwen3", model_type=model_type)


def _gpt2_style(config: dict[str, Any]) -> ModelShape:
    hidden, heads = int(_require(config, "n_embd", "hidden_size")), int(_require(config, "n_head"))
    return ModelShape(
        vocab_size=int(_require(config, "vocab_size")), hidden_size=hidden,
        num_layers=int(_require(config, "n_layer")), num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=int(config.get("n_inner") or 4 * hidden), gated_mlp=False,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)), layer_norm=True, qkv_bias=True,
        o_bias=True, mlp_bias=True, max_positions=int(_require(config, "n_positions", "max_position_embeddings")),
        model_type="gpt2")


def shape_from_hf_config(config: dict[str, Any]) -> ModelShape:
    """A :class:`ModelShape` from a parsed Hugging Face ``config.json``; ValueError for unsupported models."""
    model_type = str(config.get("model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if config.get("num_local_experts") or config.get("num_experts"):
        raise ValueError("mixture-of-experts configs are not supported")
    return _gpt2_style(config) if model_type in GPT2_STYLE else _llama_style(config, model_type)
