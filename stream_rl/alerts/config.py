"""Configuration of the alert rules (``cfg.alerts``).

Consumes: nothing (a pydantic section, validated when the root config is loaded).
Produces: :class:`AlertsConfig`, read by every role process's alert engine.
Guarantees: every threshold has bounds and a default; each rule has its own action.
"""

from __future__ import annotations

from pydantic import Field

from stream_rl.config_base import Section


class AlertsConfig(Section):
    """Alert thresholds and per-alert actions (log | pause | stop)."""

    enabled: bool = Field(True, description="evaluate the alert rules at all")
