"""Applying a LoRA adapter version (``WeightsManifest.adapter_rank`` set) to a generation model's weights.

Consumes: the model's current weights by name, the base weights kept from before the first adapter, the
version's adapter tensors (wire names, :mod:`stream_rl.models.lora`) and its scale ``alpha / r``.
Produces: the new value of every weight an adapter touches, now or in an earlier version, and the base weights
to keep.
Guarantees:
- Every merged weight is ``W0 + scale * B A`` from the kept base ``W0``, never from the weight the previous
  version left: versions never accumulate. A module adapted before but not in this version goes back to ``W0``.
- All or nothing: :func:`adapted_weights` computes every new value (or raises
  :class:`~producers.engines.base.WeightsMismatch` naming the tensor: not an adapter name, no such module in the
  model, shapes that do not fit) before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from producers.engines.base import WeightsMismatch
from stream_rl.models.lora import adapter_pairs, merged_weight


def adapted_weights(weights: Mapping[str, Tensor], bases: Mapping[str, Tensor], adapter: Mapping[str, Tensor],
                    scale: float) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(new values by weight name, bases to keep)`` for applying ``adapter`` at ``scale`` (module docstring);
    ``weights`` is the model's name -> weight map, ``bases`` the base weights kept so far."""
    try:
        pairs = adapter_pairs(adapter)
    except ValueError as exc:
        raise WeightsMismatch(f"adapter version: {exc}") from exc
    kept = dict(bases)
    for module in pairs:
        name = f"{module}.weight"
        if name not in weights:
            raise WeightsMismatch(f"adapter for {module!r}: the model has no weight {name!r} (another base?)")
        kept.setdefault(name, weights[name].detach().clone())  # first adapter on this module: its base
    new = {name: base for name, base in kept.items()}  # not adapted in this version: back to W0
    for module, pair in pairs.items():
        name = f"{module}.weight"
        try:
            new[name] = merged_weight(kept[name], pair.a, pair.b, scale)
        except ValueError as exc:
            raise WeightsMismatch(f"adapter for {module!r}: {exc}") from exc
    return new, kept
