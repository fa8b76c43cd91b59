"""Configuration of the alert rules (``cfg.alerts``), generated from the rule table.

Consumes: :data:`stream_rl.alerts.table.RULES` (a pydantic section is built per row, validated when the root
config is loaded).
Produces: :class:`AlertsConfig` (``enabled`` plus one section per rule, ``cfg.alerts.<rule>.<field>``), read by
every role process's alert engine (:mod:`stream_rl.alerts.engine`); ``RULE_SECTIONS``, the section class per rule.
Guarantees: every threshold has its row's bounds, default and description; each rule has its own ``enabled`` flag
and ``action`` (``log``: a record and a log line only; ``pause``: the process stops consuming until the alert
resolves; ``stop``: the process exits non-zero, code 3, after a final checkpoint). ``pause`` is refused, naming
the rule, for the rules a pause cannot clear (``consumer_lag``, ``trainer_stalled``), and a row's ``at_most``
pairs are checked. The formulas are in :mod:`stream_rl.alerts.rules` and ``docs/alerts.md``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, create_model, model_validator

from stream_rl.alerts.table import RULES, Action, RuleSpec
from stream_rl.config.base import Section

_ENABLED = "evaluate this rule"
_ACTION = "what a firing alert does besides its record and log line: log | pause (stop consuming until it " \
          "resolves) | stop (exit code 3 after a final checkpoint)"


class RuleSection(Section):
    """The section of one alert rule; ``spec`` is its row of the rule table."""

    spec: ClassVar[RuleSpec]
    enabled: bool = Field(True, description=_ENABLED)
    action: Action = Field("log", description=_ACTION)

    @model_validator(mode="after")
    def _row_checks(self) -> RuleSection:
        spec = type(self).spec
        if spec.pause_never_clears and self.action == "pause":
            raise ValueError(f"alerts.{spec.name}.action = pause would never resolve ({spec.pause_never_clears}); "
                             f"use log or stop")
        for low, high in spec.at_most:
            if getattr(self, low) > getattr(self, high):
                raise ValueError(f"alerts.{spec.name}.{low} ({getattr(self, low)}) must be <= {high} "
                                 f"({getattr(self, high)})")
        return self


def rule_section(spec: RuleSpec) -> type[RuleSection]:
    """The pydantic section of one row: ``enabled``, ``action`` (the row's default) and the row's thresholds."""
    fields: dict[str, Any] = {"action": (Action, Field(spec.action, description=_ACTION))}
    for t in spec.thresholds:
        fields[t.name] = (type(t.default), Field(t.default, description=t.description, **t.bounds))
    name = "".join(part.title() for part in spec.name.split("_")) + "Rule"
    model = create_model(name, __base__=RuleSection, __module__=__name__, __doc__=f"`{spec.name}`: {spec.holds}.",
                         **fields)
    model.spec = spec
    return model


RULE_SECTIONS: dict[str, type[RuleSection]] = {spec.name: rule_section(spec) for spec in RULES}

AlertsConfig: type[Section] = create_model(
    "AlertsConfig", __base__=Section, __module__=__name__,
    __doc__="Alert thresholds and per-alert actions (log | pause | stop).",
    enabled=(bool, Field(True, description="evaluate the alert rules at all")),
    **{name: (model, Field(default_factory=model)) for name, model in RULE_SECTIONS.items()},
)
