"""A tap on a real training engine (helpers only, no tests here)."""

from __future__ import annotations

import torch


class GradientTap:
    """Wraps a real engine's ``step`` to copy the accumulated gradients just before the update applies them."""

    def __init__(self, engine):
        self.grads: list[dict[str, torch.Tensor]] = []
        self._step = engine.step
        self.engine = engine
        engine.step = self

    def __call__(self, lr):
        self.grads.append({n: p.grad.clone() for n, p in self.engine.module.named_parameters() if p.grad is not None})
        return self._step(lr)
