"""LoRA adapter tensors on the wire, and the merge ``W = W0 + (alpha / r) * B A`` as pure functions.

Consumes: adapter tensors under their wire names (``{module}.lora_A.weight`` ``[r, in]`` and
``{module}.lora_B.weight`` ``[out, r]``, ``{module}`` the base model's module path, e.g.
``model.layers.0.self_attn.q_proj``), the scale ``alpha / r`` and the base weights ``W0`` ``[out, in]``.
Produces: the merged weight of each adapted module, and the wire names of ``peft``'s parameter names.
Guarantees:
- :func:`merged_weight` is computed from the *base* weight every time (never from a previously merged one), in
  float32, and cast back to the base's dtype: applying version v after version u gives exactly what applying v
  alone gives, so versions never accumulate.
- :func:`adapter_pairs` refuses (``ValueError`` naming the tensor) a name that is not an adapter tensor, an
  ``A`` without its ``B`` (or the reverse), and ranks that disagree between ``A`` and ``B``.
- No ``peft`` import: producers apply adapters with torch alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

_PEFT_PREFIX = "base_model.model."
_WIRE = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
_PEFT = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")


@dataclass(frozen=True)
class AdapterPair:
    """One adapted module: ``a`` ``[r, in]``, ``b`` ``[out, r]``."""

    module: str
    a: Tensor
    b: Tensor

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


def lora_scale(rank: int, alpha: float) -> float:
    """The LoRA scaling ``alpha / r`` (Hu et al. 2021, section 4.1)."""
    if rank < 1 or not alpha > 0:
        raise ValueError(f"LoRA needs rank >= 1 and alpha > 0, got rank={rank}, alpha={alpha}")
    return alpha / rank


def merged_weight(base: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``W0 + scale * B @ A`` ``[out, in]`` from ``base`` ``[out, in]``, ``a`` ``[r, in]``, ``b`` ``[out, r]``, in
    float32, returned in ``base``'s dtype and device."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(base.shape):
        raise ValueError(f"adapter shapes A {list(a.shape)}, B {list(b.shape)} do not fit weight {list(base.shape)}")
    delta = b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)  # [out, in]
    return (base.float() + scale * delta).to(base.dtype)


def wire_name(peft_name: str) -> str:
    """``base_model.model.{module}.lora_A.default.weight`` (a peft parameter) -> ``{module}.lora_A.weight``."""
    name = peft_name.removeprefix(_PEFT_PREFIX)
    match = _PEFT.match(name)
    if match is None:
        raise ValueError(f"{peft_name!r} is not a LoRA adapter parameter")
    return f"{match['module']}.lora_{match['which']}.weight"


def adapter_pairs(tensors: Mapping[str, Tensor]) -> dict[str, AdapterPair]:
    """Wire-named adapter tensors grouped by module (see the guarantees for what is refused)."""
    halves: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors.items():
        match = _WIRE.match(name)
        if match is None:
            raise ValueError(f"{name!r} is not an adapter tensor ({{module}}.lora_A.weight / .lora_B.weight)")
        halves.setdefault(match["module"], {})[match["which"]] = tensor
    pairs = {}
    for module, half in sorted(halves.items()):
        if set(half) != {"A", "B"}:
            missing = ({"A", "B"} - set(half)).pop()
            raise ValueError(f"{module}.lora_{missing}.weight is missing (an adapter needs both A and B)")
        if half["A"].dim() != 2 or half["B"].dim() != 2 or half["A"].shape[0] != half["B"].shape[1]:
            raise ValueError(f"{module}: lora_A {list(half['A'].shape)} and lora_B {list(half['B'].shape)} "
                             f"disagree on the rank")
        pairs[module] = AdapterPair(module, half["A"], half["B"])
    return pairs
