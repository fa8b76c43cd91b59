"""Versioned weight broadcast: the trainer publishes policy versions, the producers and the evaluator follow and fetch
them.

Consumes/produces: see :mod:`stream_rl.weights.publisher` (trainer side), :mod:`stream_rl.weights.receiver`
(follower side), :mod:`stream_rl.weights.payload` (pure serialization and checks), :mod:`stream_rl.weights.delta`
(versions sent as what changed), :mod:`stream_rl.weights.config` (``cfg.weights``) and docs/weights.md.
Guarantees: importing this package loads neither torch, kafka nor pydantic; every name below (the root config
embeds :class:`WeightsConfig`) is imported on first use, so the pure payload module runs where only torch and
safetensors exist (the GPU script).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "WeightsConfig": "stream_rl.weights.config",
    "WeightsPublisher": "stream_rl.weights.publisher",
    "choose_mode": "stream_rl.weights.publisher",
    "WeightsReceiver": "stream_rl.weights.receiver",
    "WeightsError": "stream_rl.weights.payload",
    "Payload": "stream_rl.weights.payload",
}

__all__ = [*_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
