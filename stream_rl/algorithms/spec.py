"""The loss settings, declared once: every hyper-parameter of :func:`~stream_rl.algorithms.policy.policy_loss` and
its off-policy correction, resolved and checked when built.

Consumes: a loss kind and its knobs, directly (``LossSpec(kind="gspo", agg=...)``) or from the trainer's
``trainer.loss`` section (``consumers.trainer.config.LossConfig``, a :class:`LossSettings`:
:meth:`LossSpec.from_config`).
Produces: :class:`LossSettings`, the one declaration (pydantic: each field's default, bounds and description, the
kind's defaults, the checks), and :class:`LossSpec`, its frozen form that the loss takes. ``clip_low``,
``clip_high`` and ``agg`` hold numbers after validation (None takes the kind's defaults from the catalogue); a
spec's ``row`` is the kind's catalogue row.
Guarantees: a spec that exists is valid: an unknown kind, a bad bound, or a knob the kind does not use (``dual_clip``
with ``cispo``) raises ValueError (pydantic's ``ValidationError``) naming the field when the spec is built, not
inside the loss; the trainer's config refuses the same values with the same words, since it is the same
declaration. Imports no torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .catalogue import (AGG_MODES, IS_MODES, LOSS_DEFAULTS, LOSS_KIND_NAMES, LOSS_KIND_ROWS, LOSS_KINDS, LossKind,
                        choices_text, loss_kind)

DEFAULT_KIND = "ppo"


def _defaults_text(name: str) -> str:
    """``'0.2 for ppo, 0.0003 for gspo, ...'``: a loss knob's per-kind defaults, from the catalogue."""
    return ", ".join(f"{row_defaults[name]} for {kind}" for kind, row_defaults in LOSS_DEFAULTS.items())


class LossSettings(BaseModel):
    """The policy loss of ``stream_rl.algorithms.policy_loss`` (its ``LossSpec``) and its off-policy correction."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal[LOSS_KIND_NAMES] = Field(  # type: ignore[valid-type]
        DEFAULT_KIND, description="policy-loss kind (stream_rl/algorithms/catalogue.py): "
                                  + choices_text(LOSS_KIND_ROWS))
    # None at construction takes the kind's catalogue default (_kind_defaults): after validation always a value
    clip_low: float = Field(None, gt=0.0, le=1.0,  # type: ignore[assignment]
                            description="ratio lower clip: 1 - clip_low; None: the kind's default: "
                                        + _defaults_text("clip_low"))
    clip_high: float = Field(None, gt=0.0, allow_inf_nan=False,  # type: ignore[assignment]
                             description="ratio upper clip: 1 + clip_high (> clip_low: DAPO); None: the kind's "
                                         "default: " + _defaults_text("clip_high"))
    dual_clip: float | None = Field(None, gt=1.0, description="dual-clip constant c > 1 for A < 0 (ppo, gspo); "
                                                              "None: off")
    off_policy_correction: bool = Field(
        True, description="multiply each token's loss by pi_prox / mu (decoupled PPO / truncated IS), with mu the "
                          "generator's behaviour logprobs; gspo uses the sequence weight (geometric mean)")
    is_cap: float | None = Field(5.0, gt=0.0, allow_inf_nan=False, description="cap C on the importance weight; "
                                 "None: uncapped; ignored without off_policy_correction")
    is_mode: Literal[IS_MODES] = Field(  # type: ignore[valid-type]
        "clamp", description="'clamp': min(w, C); 'mask': w = 0 where w > C")
    agg: Literal[AGG_MODES] = Field(  # type: ignore[valid-type]
        None, description="loss aggregation over tokens and sequences (see docs/algorithms.md); None: the kind's "
                          "default: " + _defaults_text("agg"))
    max_len: int | None = Field(
        None, ge=1, description="seq-mean-token-sum-norm (Dr. GRPO): the constant length normaliser; None: "
                                "producer.max_new_tokens (the generation budget)")

    @field_validator("kind", mode="before")
    @classmethod
    def _known_kind(cls, value: Any) -> Any:
        if isinstance(value, str):
            loss_kind(value)  # ValueError naming the kind and the known kinds
        return value

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, data: Any) -> Any:
        """clip_low, clip_high and agg left out (or None) take the kind's catalogue defaults."""
        if not isinstance(data, dict):
            return data
        kind = data.get("kind", DEFAULT_KIND)
        defaults = LOSS_DEFAULTS.get(kind) if isinstance(kind, str) else None
        if defaults is None:  # an unknown kind: the kind field says so
            return data
        return {**data, **{name: value for name, value in defaults.items() if data.get(name) is None}}

    @model_validator(mode="after")
    def _kind_uses_its_knobs(self) -> LossSettings:
        row = LOSS_KINDS[self.kind]
        if self.dual_clip is not None and "dual_clip" not in row.options:
            raise ValueError(f"dual_clip={self.dual_clip} does not apply to kind={self.kind!r} (it uses "
                             f"{', '.join(row.options)}): leave dual_clip unset")
        return self


class LossSpec(LossSettings, frozen=True):
    """The loss's hyper-parameters as :func:`~stream_rl.algorithms.policy.policy_loss` takes them: the fields of
    :class:`LossSettings` (formulas: ``surrogates.py`` and docs/algorithms.md), frozen.

    ``kind``: a loss kind of the catalogue; ``clip_low`` in (0, 1] and ``clip_high`` > 0 (the ratio's clip range
    [1 - clip_low, 1 + clip_high]); ``dual_clip`` > 1 or None; ``is_cap`` > 0 or None (cap on the off-policy
    weight, used when ``behavior_logp`` is given) applied by ``is_mode``; ``off_policy_correction`` whether the
    trainer gives the loss the behaviour logprobs; ``agg`` an aggregation mode; ``max_len`` the generation budget of
    ``seq-mean-token-sum-norm``.
    """

    @property
    def row(self) -> LossKind:
        """The kind's catalogue row (level, defaults, citation)."""
        return loss_kind(self.kind)

    @property
    def level(self) -> str:
        """"token" or "sequence": the level of the kind's ratio and of its off-policy importance weight."""
        return self.row.level

    @classmethod
    def from_config(cls, settings: LossSettings) -> LossSpec:
        """The frozen spec of a ``trainer.loss`` section (any :class:`LossSettings`): its values as they are."""
        return cls.model_validate(settings.model_dump())
