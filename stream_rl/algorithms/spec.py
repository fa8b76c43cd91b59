"""The loss spec: every hyper-parameter of :func:`~stream_rl.algorithms.policy.policy_loss`, resolved and checked once.

Consumes: a loss kind and its knobs, directly (``LossSpec(kind="gspo", agg=...)``) or from the trainer's
``trainer.loss`` section (:meth:`LossSpec.from_config`).
Produces: a frozen :class:`LossSpec` whose ``clip_low``, ``clip_high`` and ``agg`` hold numbers (None takes the
kind's defaults from the catalogue) and whose ``row`` is the kind's catalogue row.
Guarantees: a spec that exists is valid: an unknown kind, a bad bound, or a knob the kind does not use (``dual_clip``
with ``cispo``) raises ValueError naming the field when the spec is built, not inside the loss. Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from .catalogue import AGG_MODES, IS_MODES, LossKind, loss_kind


def _positive(value: float, name: str) -> None:
    if not 0.0 < float(value) < math.inf:
        raise ValueError(f"{name} must be > 0, got {value}")


class LossSettings(Protocol):
    """What :meth:`LossSpec.from_config` reads of a ``trainer.loss`` section (``consumers.trainer.config.LossConfig``;
    the core does not import the trainer's config)."""

    kind: str
    clip_low: float | None
    clip_high: float | None
    dual_clip: float | None
    off_policy_correction: bool
    is_cap: float | None
    is_mode: str
    agg: str | None
    max_len: int | None


@dataclass(frozen=True)
class LossSpec:
    """Hyper-parameters of the policy loss (formulas: ``surrogates.py`` and docs/algorithms.md).

    ``kind``: a loss kind of the catalogue; ``clip_low`` in (0, 1] and ``clip_high`` > 0 (the ratio's clip range
    [1 - clip_low, 1 + clip_high]); ``dual_clip`` > 1 or None; ``is_cap`` > 0 or None (cap on the off-policy
    weight, which needs ``behavior_logp``) applied by ``is_mode``; ``agg`` an aggregation mode; ``max_len`` the
    generation budget of ``seq-mean-token-sum-norm``.
    """

    kind: str = "ppo"
    # None at construction takes the kind's catalogue default (``__post_init__``): after it, always a value
    clip_low: float = None  # type: ignore[assignment]
    clip_high: float = None  # type: ignore[assignment]
    dual_clip: float | None = None
    is_cap: float | None = None
    is_mode: str = "clamp"
    agg: str = None  # type: ignore[assignment]
    max_len: int | None = None

    def __post_init__(self) -> None:
        row = loss_kind(self.kind)  # ValueError naming the kind and the known kinds
        for name in ("clip_low", "clip_high", "agg"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(row, name))
        self._check(row)

    def _check(self, row: LossKind) -> None:
        if self.agg not in AGG_MODES:
            raise ValueError(f"unknown agg {self.agg!r}; expected one of {', '.join(map(repr, AGG_MODES))}")
        if self.is_mode not in IS_MODES:
            raise ValueError(f"unknown is_mode {self.is_mode!r}; expected one of {', '.join(map(repr, IS_MODES))}")
        if not 0.0 < float(self.clip_low) <= 1.0:
            raise ValueError(f"clip_low must be in (0, 1], got {self.clip_low}")
        _positive(self.clip_high, "clip_high")
        if self.dual_clip is not None:
            if not float(self.dual_clip) > 1.0:
                raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
            if "dual_clip" not in row.options:
                raise ValueError(f"dual_clip does not apply to loss kind {row.name!r} (it uses "
                                 f"{', '.join(row.options)}): set dual_clip to None")
        if self.is_cap is not None:
            _positive(self.is_cap, "is_cap")

    @property
    def row(self) -> LossKind:
        """The kind's catalogue row (level, defaults, citation)."""
        return loss_kind(self.kind)

    @property
    def level(self) -> str:
        """"token" or "sequence": the level of the kind's ratio and of its off-policy importance weight."""
        return self.row.level

    @classmethod
    def from_config(cls, loss_cfg: LossSettings) -> LossSpec:
        """The spec of a ``trainer.loss`` section (:class:`LossSettings`): its knobs as they are, and no IS cap
        without ``off_policy_correction`` (there is no weight to cap)."""
        correction = bool(loss_cfg.off_policy_correction)
        return cls(kind=loss_cfg.kind, clip_low=loss_cfg.clip_low,  # type: ignore[arg-type]  # None: the default
                   clip_high=loss_cfg.clip_high,  # type: ignore[arg-type]
                   dual_clip=loss_cfg.dual_clip, is_cap=loss_cfg.is_cap if correction else None,
                   is_mode=loss_cfg.is_mode, agg=loss_cfg.agg,  # type: ignore[arg-type]
                   max_len=loss_cfg.max_len)
