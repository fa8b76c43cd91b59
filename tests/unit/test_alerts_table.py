"""The alert rule table serves the config, the engine and docs/alerts.md: one row per rule, and each consumer of
the table sees the row's fields, bounds, default action, pause refusal and history."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from stream_rl.alerts.config import RULE_SECTIONS, AlertsConfig
from stream_rl.alerts.engine import AlertEngine
from stream_rl.alerts.rules import EVALUATORS
from stream_rl.alerts.table import RULES, rules_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_docs_hold_the_generated_rule_table():
    assert rules_markdown() in (ROOT / "docs" / "alerts.md").read_text()
    assert rules_markdown().count("\n") == len(RULES) + 2


def test_each_row_is_one_config_section_with_described_bounded_fields():
    assert list(AlertsConfig.model_fields) == ["enabled"] + [r.name for r in RULES]
    for row in RULES:
        assert row.kind in EVALUATORS
        model = AlertsConfig.model_fields[row.name].annotation
        assert model is RULE_SECTIONS[row.name]
        assert list(model.model_fields) == ["enabled", "action"] + [t.name for t in row.thresholds]
        assert all(f.description for f in model.model_fields.values())
        assert model().action == row.action and model().enabled is True
        for t in row.thresholds:
            field = model.model_fields[t.name]
            assert field.annotation is type(t.default) and field.default == t.default
            assert t.bounds, f"{row.name}.{t.name} has no bounds"
            for kind, value in t.bounds.items():
                assert any(getattr(m, kind, None) == value for m in field.metadata), (row.name, t.name, kind)
    assert AlertsConfig().kl_ref_high.max_kl == 1.0 and AlertsConfig().loss_nonfinite.action == "stop"


def test_bounds_and_pause_refusal_come_from_the_row():
    with pytest.raises(ValidationError, match="max_kl"):
        AlertsConfig(kl_ref_high={"max_kl": 0.0})  # gt=0
    with pytest.raises(ValidationError, match="min_samples"):
        AlertsConfig(memory_growth={"min_samples": 2})  # ge=3
    refused = {r.name for r in RULES if r.pause_never_clears}
    assert refused == {"consumer_lag", "trainer_stalled"}
    for row in RULES:
        if row.name in refused:
            with pytest.raises(ValidationError, match=rf"alerts.{row.name}.action = pause would never resolve"):
                AlertsConfig(**{row.name: {"action": "pause"}})
        else:
            assert getattr(AlertsConfig(**{row.name: {"action": "pause"}}), row.name).action == "pause"
    section = AlertsConfig().dlq_rate
    section.action = "stop"  # assignments are validated too
    with pytest.raises(ValidationError, match="pause would never resolve"):
        AlertsConfig().trainer_stalled.action = "pause"


def test_the_engine_keeps_the_history_each_row_asks_for():
    cfg = AlertsConfig(reward_drop={"window_steps": 3, "lookback_windows": 4}, kl_ref_high={"consecutive": 5},
                       logprob_mismatch={"consecutive": 2})
    trainer = AlertEngine(cfg, "trainer", "trainer-1")
    assert [r.name for r in trainer.rules] == [r.name for r in RULES]
    windows = trainer._windows
    assert windows["reward/mean"].keep == 3 * (4 + 1)  # W * (lookback + 1)
    assert windows["kl/ref_mean"].keep == 5 and windows["mismatch/logp_abs_diff"].keep == 2
    assert (windows["lag/position_total"].horizon_s, windows["lag/position_total"].keep) == (60.0, 2)
    assert (windows["step"].horizon_s, windows["dlq/total"].horizon_s) == (600.0, 60.0)
    assert windows["process/rss_bytes"].horizon_s == windows["gpu/allocated_bytes"].horizon_s == 600.0
    # trainer_stalled is the trainer's only; a producer keeps no `step` window for it
    producer = AlertEngine(cfg, "producer", "producer-1")
    assert "trainer_stalled" not in [r.name for r in producer.rules] and "step" not in producer._windows
    assert [r.bound for r in trainer.rules if r.name in ("kl_ref_high", "consumer_lag")] == [1.0, 1000]
