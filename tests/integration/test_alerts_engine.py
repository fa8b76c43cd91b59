"""The alert engine (transitions once, action precedence, config switches), the open-alerts fold, and the monitor
publishing to a real alerts topic with its log lines."""

from __future__ import annotations

import logging
import math

import pytest

from schemas import Alert, decode, encode
from stream_rl.alerts.config import AlertsConfig
from stream_rl.alerts.engine import AlertEngine, strongest
from stream_rl.alerts.monitor import EXIT_CODE_STOP, AlertMonitor, AlertStop
from stream_rl.alerts.read import open_alerts


def test_transitions_are_reported_once_and_alerts_are_valid_messages():
    e = AlertEngine(AlertsConfig(), "trainer", "trainer-1a2b")
    first = e.observe(0, {"loss/total": math.nan, "unknown/key": 1.0, "step": None})
    assert [(a.name, a.state) for a in first] == [("loss_nonfinite", "firing")]
    assert decode(encode(first[0]), "alert") == first[0]  # passes the wire validation
    assert e.observe(1, {"loss/total": math.nan}) == [] and e.observe(2, {}) == []
    assert e.firing == ["loss_nonfinite"] and e.action == "stop"
    resolved = e.observe(3, {"loss/total": 0.5})
    assert [(a.name, a.state, a.value) for a in resolved] == [("loss_nonfinite", "resolved", 0.5)]
    assert e.observe(4, {"loss/total": 0.25}) == []
    assert e.firing == [] and e.action == "none"


def test_action_is_the_strongest_among_firing_alerts():
    assert strongest([]) == "none" and strongest(["log", "stop", "pause"]) == "stop"
    cfg = AlertsConfig(kl_ref_high={"max_kl": 1.0, "action": "pause"},
                       logprob_mismatch={"max_abs_diff": 1.0, "action": "log"})
    e = AlertEngine(cfg, "trainer", "trainer-1")
    e.observe(0, {"mismatch/logp_abs_diff": 2.0})
    assert e.action == "log"
    e.observe(1, {"kl/ref_mean": 2.0})
    assert e.action == "pause"
    e.observe(2, {"loss/total": math.inf})
    assert e.action == "stop" and e.firing == ["loss_nonfinite", "kl_ref_high", "logprob_mismatch"]
    e.observe(3, {"loss/total": 1.0})
    assert e.action == "pause"
    e.observe(4, {"kl/ref_mean": 0.5})
    assert e.action == "log"
    e.observe(5, {"mismatch/logp_abs_diff": 0.5})
    assert e.action == "none"


def test_disabled_rules_and_disabled_alerts_never_fire():
    off = AlertEngine(AlertsConfig(enabled=False), "trainer", "trainer-1")
    assert off.rules == [] and off.observe(0, {"loss/total": math.nan}) == []
    one_off = AlertEngine(AlertsConfig(loss_nonfinite={"enabled": False}), "trainer", "trainer-1")
    assert one_off.observe(0, {"loss/total": math.nan}) == []
    assert [a.name for a in one_off.observe(1, {"optim/grad_norm": math.nan})] == ["grad_norm_nonfinite"]


def test_config_rejects_a_span_longer_than_the_window_unknown_actions_and_pauses_that_never_clear():
    with pytest.raises(ValueError, match="min_span_s"):
        AlertsConfig(memory_growth={"window_s": 60, "min_span_s": 120})
    with pytest.raises(ValueError, match="action"):
        AlertsConfig(consumer_lag={"action": "explode"})
    # a pause that can only make its own condition worse is refused, by name
    with pytest.raises(ValueError, match=r"alerts.consumer_lag.action = pause would never resolve"):
        AlertsConfig(consumer_lag={"action": "pause"})
    with pytest.raises(ValueError, match=r"alerts.trainer_stalled.action = pause would never resolve"):
        AlertsConfig(trainer_stalled={"action": "pause"})
    assert AlertsConfig(consumer_lag={"action": "stop"}, dlq_rate={"action": "pause"}).dlq_rate.action == "pause"


def _alert(name: str, state: str, instance: str, at: float) -> Alert:
    return Alert(name=name, state=state, action="log", role="scorer", instance_id=instance, message="m",
                 created_at=at)


def test_open_alerts_keeps_the_latest_transition_per_instance_and_name():
    records = [
        _alert("consumer_lag", "firing", "scorer-a", 1.0),
        _alert("consumer_lag", "firing", "scorer-b", 2.0),
        _alert("dlq_rate", "firing", "scorer-a", 3.0),
        _alert("consumer_lag", "resolved", "scorer-a", 4.0),
        _alert("memory_growth", "resolved", "scorer-b", 6.0),  # out of order across partitions:
        _alert("memory_growth", "firing", "scorer-b", 5.0),  # created_at decides
        "not an alert",
    ]
    got = open_alerts(records)
    assert [(a.instance_id, a.name) for a in got] == [("scorer-b", "consumer_lag"), ("scorer-a", "dlq_rate")]
    assert open_alerts([]) == []


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
