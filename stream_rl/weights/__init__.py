"""Versioned weight broadcast: the trainer publishes policy versions, producers follow and fetch them.

Consumes/produces: see :mod:`stream_rl.weights.publisher` (trainer side), :mod:`stream_rl.weights.receiver`
(producer side), :mod:`stream_rl.weights.payload` (pure serialization and checks) and docs/weights.md.
Guarantees: importing this package (e.g. for :class:`WeightsConfig`, which the root config embeds) loads neither
torch nor kafka; the classes below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from stream_rl.weights.config import WeightsConfig

_LAZY = {
    "WeightsPublisher": "stream_rl.weights.publisher",
    "choose_mode": "stream_rl.weights.publisher",
    "WeightsReceiver": "stream_rl.weights.receiver",
    "WeightsError": "stream_rl.weights.payload",
    "Payload": "stream_rl.weights.payload",
}

__all__ = ["WeightsConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
