"""Where and in what dtype a role runs its models: the ``device`` and ``dtype`` settings made torch objects.

Consumes: a ``device`` setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``: :data:`stream_rl.config.base.DEVICE_PATTERN`,
checked when the config loads) with the dotted name of the setting, and a ``dtype`` name.
Produces: a :class:`torch.device` and a :class:`torch.dtype`.
Guarantees: ``auto`` is CUDA when torch sees a GPU, else CPU, so a default config runs unchanged on a CPU machine; a
CUDA device this machine does not have raises ValueError naming the setting (e.g. ``scorer.device='cuda:1'``) when
the role starts, before any weights are read, instead of a CUDA error deep inside the first ``.to()``.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, setting: str) -> torch.device:
    """``setting`` (e.g. ``"scorer.device"``) holding ``name`` -> a torch device; ``auto``: CUDA if torch sees one."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{setting}={name!r} but torch sees no CUDA device here: use 'auto' or 'cpu'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{setting}={name!r} but torch sees only {torch.cuda.device_count()} CUDA device(s)")
    return device


def torch_dtype(name: str) -> torch.dtype:
    """A ``dtype`` setting (``float32``, ``bfloat16``, ``float16``) -> the torch dtype."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (expected one of {', '.join(DTYPES)})")
    return DTYPES[name]
