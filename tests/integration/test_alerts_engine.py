"""The alert monitor publishing transitions to a real alerts topic with its log lines. The engine's transitions,
action precedence and config switches: tests/unit/test_alerts_transitions.py."""

from __future__ import annotations

import logging
import math

import pytest

from stream_rl.alerts.monitor import EXIT_CODE_STOP, AlertMonitor, AlertStop
from stream_rl.alerts.read import open_alerts


@pytest.mark.broker
def test_monitor_publishes_transitions_to_the_alerts_topic_and_logs_them(make_config, caplog):
    from support.topics import read_records

    from stream_rl.transport.client import Transport

    cfg = make_config()
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    monitor = AlertMonitor.for_role(cfg, "trainer", "trainer-abc123", sink, t.names.alerts,
                                    logging.getLogger("test.alerts"))
    with caplog.at_level(logging.INFO, logger="test.alerts"):
        monitor.observe(10.0, {"loss/total": math.nan, "step": 3})
        assert monitor.stop_alert is not None and not monitor.paused and monitor.firing == ["loss_nonfinite"]
        with pytest.raises(AlertStop) as stop:
            monitor.check_stop()
        assert stop.value.exit_code == EXIT_CODE_STOP == 3 and stop.value.alert.name == "loss_nonfinite"
        monitor.observe(11.0, {"loss/total": 0.5})
        monitor.check_stop()  # resolved: no longer raises
    assert sink.pending == 0 and monitor.published == 2

    records = read_records(t, t.names.alerts, "alert")
    assert [r.key for r in records] == [b"loss_nonfinite", b"loss_nonfinite"]
    alerts = [r.value for r in records]
    assert [(a.state, a.action, a.role, a.instance_id) for a in alerts] == [
        ("firing", "stop", "trainer", "trainer-abc123"), ("resolved", "stop", "trainer", "trainer-abc123")]
    assert alerts[0].message == "loss/total is nan (not finite)" and alerts[0].value is None
    assert open_alerts(alerts) == []

    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "test.alerts"]
    assert lines == [
        (logging.WARNING, "alert loss_nonfinite firing (action stop) on trainer trainer-abc123: "
                          "loss/total is nan (not finite)"),
        (logging.INFO, "alert loss_nonfinite resolved (action stop) on trainer trainer-abc123: loss/total is 0.5"),
    ]
