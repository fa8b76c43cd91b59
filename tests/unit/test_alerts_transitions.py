"""The alert engine: transitions reported once as valid messages, the strongest action, disabled rules, config
checks and the latest transition per instance."""

from __future__ import annotations

import math

import pytest

from schemas import Alert, decode, encode
from stream_rl.alerts.config import AlertsConfig
from stream_rl.alerts.engine import AlertEngine, strongest
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
