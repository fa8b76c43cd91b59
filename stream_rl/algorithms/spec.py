"""The loss spec: every hyper-parameter of :func:`~stream_rl.algorithms.policy.policy_loss`, declared, resolved and
checked once.

Consumes: a loss kind and its knobs, directly (``LossSpec(kind="gspo", agg=...)``) or from the trainer's
``trainer.loss`` section (:meth:`LossSpec.from_config`).
Produces: a frozen :class:`LossSpec` whose ``clip_low``, ``clip_high`` and ``agg`` hold numbers (None takes the
kind's defaults from the catalogue) and whose ``row`` is the kind's catalogue row; :data:`LOSS_FIELDS`, the one
declaration of each loss setting (the dataclass field: its default, and in its metadata its description and bounds
under the names of pydantic's ``Field`` keywords: ``gt``, ``ge``, ``le``, ``allow_inf_nan``), from which the
trainer's ``trainer.loss`` section builds its fields; :func:`check_settings`, the checks both run.
Guarantees: a spec that exists is valid: an unknown kind, a value outside its declared bounds, or a knob the kind
does not use (``dual_clip`` with ``cispo``) raises ValueError naming the field when the spec is built, not inside
the loss. Each default, bound, description and check is written here only: the section's fields are these
declarations (``consumers/trainer/config.py``), and its validator runs :func:`check_settings` through the spec, so a
value the spec refuses the section refuses too. Imports no torch and no pydantic (``bench/gpu.py`` runs the loss on
a machine that has neither the config's libraries nor Kafka).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .catalogue import (AGG_MODES, IS_MODES, LOSS_DEFAULTS, LOSS_KIND_ROWS, LOSS_OPTIONS, LossKind, choices_text,
                        loss_kind)

BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "lt": (operator.lt, "<"), "le": (operator.le, "<=")}
"""The bound keywords a declaration may carry (pydantic's ``Field`` names) and what each requires of a value."""


def _defaults_text(name: str) -> str:
    """``'0.2 for ppo, 0.0003 for gspo, ...'``: a loss knob's per-kind defaults, from the catalogue."""
    return ", ".join(f"{row_defaults[name]} for {kind}" for kind, row_defaults in LOSS_DEFAULTS.items())


def setting(default: Any, description: str, **bounds: float | bool) -> Any:
    """The declaration of one loss setting: a dataclass field with ``default`` whose metadata holds ``description``
    and ``bounds`` (``gt``, ``ge``, ``lt``, ``le``; ``allow_inf_nan=False`` for a finite number), keyed as pydantic's
    ``Field`` keywords so that the trainer's section passes them to ``Field`` as they are. A bound applies to a value
    that is not None."""
    unknown = set(bounds) - set(BOUNDS) - {"allow_inf_nan"}
    if unknown:
        raise TypeError(f"unknown bound keywords {sorted(unknown)}; known: {sorted(BOUNDS)}, allow_inf_nan")
    return dataclasses.field(default=default, metadata={"description": description, **bounds})


def check_bounds(name: str, value: Any, declared: Mapping[str, Any]) -> None:
    """ValueError naming ``name`` when ``value`` (not None) breaks one of the bounds ``declared`` (a setting's
    metadata)."""
    if value is None:
        return
    if declared.get("allow_inf_nan") is False and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    for key, (holds, sign) in BOUNDS.items():
        if key in declared and not holds(value, declared[key]):
            raise ValueError(f"{name} must be {sign} {declared[key]}, got {value}")


def check_kind_options(row: LossKind, values: Mapping[str, Any]) -> None:
    """ValueError naming the knob when ``values`` set a knob of :data:`LOSS_OPTIONS` that the kind ``row`` does not
    use (``dual_clip`` with ``cispo``)."""
    for name in LOSS_OPTIONS:
        if name not in row.options and values.get(name) is not None:
            raise ValueError(f"{name}={values[name]} does not apply to kind={row.name!r} (it uses "
                             f"{', '.join(row.options)}): leave {name} unset")


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
    """Hyper-parameters of the policy loss (formulas: ``surrogates.py`` and docs/algorithms.md); each field's
    metadata is its description and bounds (:func:`setting`).

    ``kind``: a loss kind of the catalogue; ``clip_low`` in (0, 1] and ``clip_high`` > 0 (the ratio's clip range
    [1 - clip_low, 1 + clip_high]); ``dual_clip`` > 1 or None; ``is_cap`` > 0 or None (cap on the off-policy
    weight, which needs ``behavior_logp``) applied by ``is_mode``; ``agg`` an aggregation mode; ``max_len`` the
    generation budget of ``seq-mean-token-sum-norm``.
    """

    kind: str = setting("ppo", "policy-loss kind (stream_rl/algorithms/catalogue.py): "
                        + choices_text(LOSS_KIND_ROWS))
    # None at construction takes the kind's catalogue default (``__post_init__``): after it, always a value
    clip_low: float = setting(None, "ratio lower clip: 1 - clip_low; None: the kind's default: "
                              + _defaults_text("clip_low"), gt=0.0, le=1.0)
    clip_high: float = setting(None, "ratio upper clip: 1 + clip_high (> clip_low: DAPO); None: the kind's default: "
                               + _defaults_text("clip_high"), gt=0.0, allow_inf_nan=False)
    dual_clip: float | None = setting(None, "dual-clip constant c > 1 for A < 0 (ppo, gspo); None: off", gt=1.0)
    # A bare spec has no behaviour logprobs, hence no weight to cap: None. The trainer's section, which corrects
    # off-policy by default, declares its own default cap (``trainer.loss.is_cap``, consumers/trainer/config.py).
    is_cap: float | None = setting(None, "cap C on the importance weight; None: uncapped; ignored without "
                                   "off_policy_correction", gt=0.0, allow_inf_nan=False)
    is_mode: str = setting("clamp", "'clamp': min(w, C); 'mask': w = 0 where w > C")
    agg: str = setting(None, "loss aggregation over tokens and sequences (see docs/algorithms.md); None: the kind's "
                       "default: " + _defaults_text("agg"))
    max_len: int | None = setting(None, "seq-mean-token-sum-norm (Dr. GRPO): the constant length normaliser; None: "
                                  "producer.max_new_tokens (the generation budget)", ge=1)

    def __post_init__(self) -> None:
        row = loss_kind(self.kind)  # ValueError naming the kind and the known kinds
        for name, value in LOSS_DEFAULTS[row.name].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        check_settings(row, {name: getattr(self, name) for name in LOSS_FIELDS})

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
        values = {name: getattr(loss_cfg, name) for name in LOSS_FIELDS}
        if not loss_cfg.off_policy_correction:
            values["is_cap"] = None
        return cls(**values)


LOSS_FIELDS: dict[str, dataclasses.Field[Any]] = {field.name: field for field in dataclasses.fields(LossSpec)}
"""Each loss setting's one declaration, by name: ``.default`` and ``.metadata`` (description and bounds)."""


def check_settings(row: LossKind, values: Mapping[str, Any]) -> None:
    """Every check of a loss's settings (defaults resolved), ValueError naming the field: the choices of ``agg`` and
    ``is_mode``, each declared bound, and the kind's knobs (:func:`check_kind_options`)."""
    if values["agg"] not in AGG_MODES:
        raise ValueError(f"unknown agg {values['agg']!r}; expected one of {', '.join(map(repr, AGG_MODES))}")
    if values["is_mode"] not in IS_MODES:
        raise ValueError(f"unknown is_mode {values['is_mode']!r}; expected one of {', '.join(map(repr, IS_MODES))}")
    for name, field in LOSS_FIELDS.items():
        check_bounds(name, values[name], field.metadata)
    check_kind_options(row, values)
