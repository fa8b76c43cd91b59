"""The neutral optimizer-state format both training engines save and load (:mod:`consumers.trainer.engines`).

Consumes: an AdamW optimizer and the named parameters of the module it updates (the torch engine), or the
per-parameter tensors DeepSpeed ZeRO consolidates (the DeepSpeed engine builds the same keys itself).
Produces: ``(tensors, meta)``: tensors keyed ``{name}::{key}`` (``exp_avg``, ``exp_avg_sq``) for safetensors, and
``meta = {"optimizer": "adamw", "scalars": {"{name}::step": {"value", "dtype"?}}, "param_groups": [...]}``
for JSON (each param group's hyper-parameters, without its parameter list).
Guarantees:
- No pickle: tensors go to safetensors, scalars (AdamW's step count, a 0-d tensor, or a JSON scalar) to JSON with
  the tensor's dtype; any other value is a :class:`~stream_rl.storage.checkpoint.CheckpointError` naming the key.
- State is keyed by parameter name, never by position: a checkpoint written by one engine loads into the other,
  and state for a parameter the module does not have is a ``CheckpointError`` listing (up to five of) them.
- Loading replaces the optimizer's whole state; moment tensors go to the device of their parameter, the step
  count stays a scalar; param groups get their saved hyper-parameters back (``betas`` as a tuple).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from stream_rl.storage.checkpoint import CheckpointError

SEP = "::"


def scalar_json(key: str, value: Any) -> dict[str, Any]:
    """``{"value": ...}`` for a JSON scalar, plus ``"dtype"`` for a 0-d tensor; anything else is refused."""
    if isinstance(value, Tensor) and value.numel() == 1 and value.dim() == 0:
        return {"value": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise CheckpointError(f"optimizer state {key!r} of type {type(value).__name__} cannot be stored without "
                          f"pickle (only tensors and JSON scalars are supported)")


def scalar_value(entry: dict[str, Any]) -> Any:
    """The inverse of :func:`scalar_json`."""
    if "dtype" in entry:
        return torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"]))
    return entry["value"]


def group_json(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters as JSON (tuples as lists, 0-d tensors as numbers), without ``params``."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        value = list(value) if isinstance(value, tuple) else value
        if isinstance(value, Tensor):
            value = value.item()
        out[key] = value
    return out


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``optimizer``'s state in the neutral format: CPU tensors by ``{name}::{key}``, and the JSON meta."""
    names = {p: n for n, p in module.named_parameters()}
    tensors, scalars = {}, {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            full = f"{names[param]}{SEP}{key}"
            if isinstance(value, Tensor) and value.dim() > 0:
                tensors[full] = value.detach().to("cpu", copy=True).contiguous()
            else:
                scalars[full] = scalar_json(full, value)
    return tensors, {"optimizer": "adamw", "scalars": scalars,
                     "param_groups": [group_json(g) for g in optimizer.param_groups]}


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor],
                         meta: dict[str, Any]) -> None:
    """Replace ``optimizer``'s state with what :func:`optimizer_state` wrote (see the module docstring)."""
    params = dict(module.named_parameters())
    states: dict[str, dict[str, Any]] = {}
    for full, value in tensors.items():
        name, key = full.rsplit(SEP, 1)
        states.setdefault(name, {})[key] = value.clone()
    for full, entry in meta["scalars"].items():
        name, key = full.rsplit(SEP, 1)
        states.setdefault(name, {})[key] = scalar_value(entry)
    unknown = sorted(set(states) - set(params))
    if unknown:
        raise CheckpointError(f"optimizer state for unknown parameters: {unknown[:5]}")
    optimizer.state.clear()
    for name, state in states.items():  # moment tensors go where their parameter lives (the step stays a scalar)
        device = params[name].device
        optimizer.state[params[name]] = {
            k: v.to(device) if isinstance(v, Tensor) and v.dim() > 0 else v for k, v in state.items()}
    for group, saved in zip(optimizer.param_groups, meta["param_groups"], strict=True):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
