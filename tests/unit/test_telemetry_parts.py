"""The parts of a role's telemetry, each alone and without a broker: the alert policy, the exporter, the reporters,
the trainer's metric names, the span-free transport, and the composition the loops use (fake sinks throughout)."""

from __future__ import annotations

import json
import math
import urllib.request
from types import SimpleNamespace

import pytest

from consumers.trainer.telemetry_names import STEP_ALERT_KEYS, exported_metrics, step_alert_values
from schemas import Alert, Heartbeat
from stream_rl.alerts.config import AlertsConfig
from stream_rl.alerts.engine import AlertEngine
from stream_rl.alerts.monitor import AlertMonitor, AlertStop
from stream_rl.telemetry.alert_policy import AlertPolicy
from stream_rl.telemetry.config import TelemetryConfig
from stream_rl.telemetry.exporter import RoleExporter
from stream_rl.telemetry.reporters import Reporters


class FakeSink:
    """Records what is sent; ``fail`` makes every flush raise (a broker that does not acknowledge)."""

    def __init__(self, fail: bool = False):
        self.sent: list[tuple[str, object, str | None]] = []
        self.flushes, self.closed, self.fail = 0, False, fail
        self.observer = None

    def send(self, topic, value, key=None):
        self.sent.append((topic, value, key))

    def flush(self, timeout_s=None):
        self.flushes += 1
        if self.fail:
            raise TimeoutError("not acknowledged")

    def close(self, timeout_s=None):
        self.closed = True


class FakeTransport:
    """A transport whose span-free copy hands out one recording sink; its own ``sink()`` must not be used."""

    def __init__(self, fail: bool = False):
        self.instance_id = "trainer-0badc0de"
        self.names = SimpleNamespace(status="r.status", alerts="r.alerts")
        self.heartbeat_sink = FakeSink(fail)

    def without_spans(self):
        return SimpleNamespace(sink=lambda: self.heartbeat_sink)

    def sink(self):
        raise AssertionError("heartbeats must go through transport.without_spans()")


def monitor(alerts: AlertsConfig, sink: FakeSink, role: str = "trainer") -> AlertMonitor:
    return AlertMonitor(AlertEngine(alerts, role, "trainer-0badc0de"), sink, "r.alerts")


# -- the alert policy ------------------------------------------------------------------------------------------------


def test_observation_carries_each_lag_measurement_once():
    policy = AlertPolicy()
    gauges = {"step": 4.0, "lag/total": 9.0, "lag/position_total": 3.0}
    assert policy.observation(gauges, None) == {"step": 4.0}  # never measured: no lag sample
    assert policy.observation(gauges, 100.0) == gauges  # a new measurement: one sample
    assert policy.observation(gauges, 100.0) == {"step": 4.0}  # the same measurement is not observed twice
    assert policy.observation(gauges, 110.0) == gauges


def test_without_a_monitor_nothing_fires_pauses_or_stops():
    policy = AlertPolicy()
    assert policy.observe({"loss/total": math.nan}) == {}
    assert not policy.paused and policy.open_alerts == ()
    policy.check_stop()  # does not raise


def test_a_nonfinite_loss_stops_until_it_is_finite_again():
    sink = FakeSink()
    policy = AlertPolicy(monitor(AlertsConfig(), sink))
    assert policy.observe({"loss/total": 0.5}, now=1.0) == {}
    policy.check_stop()
    assert policy.observe({"loss/total": math.nan}, now=2.0) == {"loss_nonfinite": True}
    assert policy.open_alerts == ("loss_nonfinite",) and not policy.paused
    with pytest.raises(AlertStop) as info:
        policy.check_stop()
    assert info.value.alert.name == "loss_nonfinite" and info.value.exit_code == 3
    assert [(t, a.name, a.state) for t, a, _ in sink.sent] == [("r.alerts", "loss_nonfinite", "firing")]
    assert policy.observe({"loss/total": 0.4}, now=3.0) == {"loss_nonfinite": False}
    policy.check_stop()
    assert policy.open_alerts == ()


def test_a_pause_rule_pauses_from_gauges_and_resumes_when_it_resolves():
    alerts = AlertsConfig(dlq_rate={"action": "pause", "max_per_minute": 1.0, "window_s": 60.0})
    policy = AlertPolicy(monitor(alerts, FakeSink(), role="scorer"))
    policy.observe({"dlq/total": 0.0}, now=0.0)
    assert not policy.paused
    assert policy.observe({"dlq/total": 30.0}, now=10.0) == {"dlq_rate": True}  # 30 dead letters in 10 s
    assert policy.paused
    policy.check_stop()  # pause is not stop
    assert policy.observe({"dlq/total": 30.0}, now=200.0) == {"dlq_rate": False}  # none for a whole window
    assert not policy.paused


# -- the trainer's names ---------------------------------------------------------------------------------------------


def test_step_alert_values_keep_nonfinite_numbers_and_drop_the_rest():
    metrics = {"loss/total": math.nan, "optim/grad_norm": 2.0, "reward/mean": None, "kl/ref_mean": "x",
               "loss/policy": 0.1, "time/step_s": 3.0}
    values = step_alert_values(metrics)
    assert set(values) == {"loss/total", "optim/grad_norm"} and math.isnan(values["loss/total"])
    assert set(STEP_ALERT_KEYS) >= set(values)


def test_exported_metrics_leave_out_the_rows_bookkeeping():
    row = {"step": 3, "time": 1e9, "policy_version": 2, "loss/total": 0.5}
    assert exported_metrics(row) == {"policy_version": 2, "loss/total": 0.5}


# -- the exporter ----------------------------------------------------------------------------------------------------


def test_exporter_counts_gauges_and_serves_its_endpoint(tmp_path):
    tcfg = TelemetryConfig(exporters=["prometheus"], http=True, http_port=0)
    exporter = RoleExporter(tcfg, "scorer", "scorer-1", tmp_path)
    record = tmp_path / "endpoints" / "scorer-1.json"
    try:
        exporter.records_in("r.rollouts", 5)
        exporter.dead_lettered("r.rollouts", "SchemaError")
        exporter.tokens(7)
        assert exporter.counts == {"records_in": 5, "records_out": 0, "tokens": 7}
        gauges = exporter.process_gauges(step=11)
        assert gauges["dlq/total"] == 1.0 and gauges["step"] == 11.0 and gauges["process/rss_bytes"] > 0
        assert exporter.tick_age() == -1.0
        url = json.loads(record.read_text())["url"]
        body = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert 'stream_rl_records_in_total{instance_id="scorer-1",role="scorer",topic="r.rollouts"} 5.0' in body
        assert 'stream_rl_errors_total{instance_id="scorer-1",role="scorer",type="SchemaError"} 1.0' in body
    finally:
        exporter.close()
    assert not record.exists()
    exporter.close()  # idempotent


# -- the reporters ---------------------------------------------------------------------------------------------------


def beat():
    from stream_rl.telemetry.heartbeat import Beat

    return Beat(time=1.0, state="ready", policy_version=2, step=5, counts={}, metrics={"step": 5.0})


def test_reporters_send_heartbeats_span_free_and_mark_the_broker_reachable(tmp_path):
    transport = FakeTransport()
    exporter = RoleExporter(TelemetryConfig(http=False), "trainer", transport.instance_id, tmp_path)
    reporters = Reporters(TelemetryConfig(heartbeat_interval_s=60.0), "trainer", transport, exporter, beat)
    try:
        assert reporters.lag is None and reporters.lag_gauges() == {} and reporters.lag_measured_at is None
        reporters.read_up_to({("t", 0): 3})  # no lag thread: nothing to do, nothing raised
    finally:
        reporters.close()
        exporter.close()
    sent = [m for _, m, _ in transport.heartbeat_sink.sent]
    assert all(isinstance(m, Heartbeat) and m.instance_id == transport.instance_id for m in sent)
    assert {t for t, _, _ in transport.heartbeat_sink.sent} == {"r.status"}
    assert sent[-1].state == "stopping" and sent[-1].step == 5 and transport.heartbeat_sink.closed
    assert exporter.health.snapshot().broker_ok_at is not None
    reporters.close()  # idempotent


def test_unacknowledged_heartbeats_make_the_broker_unreachable(tmp_path):
    transport = FakeTransport(fail=True)
    exporter = RoleExporter(TelemetryConfig(http=False), "trainer", transport.instance_id, tmp_path)
    reporters = Reporters(TelemetryConfig(heartbeat_interval_s=60.0), "trainer", transport, exporter, beat)
    reporters.close()
    exporter.close()
    snap = exporter.health.snapshot()
    assert snap.broker_ok_at is None and snap.broker_error.startswith("TimeoutError")


def test_lag_gauges_read_the_latest_measurement(tmp_path):
    transport = FakeTransport()
    exporter = RoleExporter(TelemetryConfig(http=False), "trainer", transport.instance_id, tmp_path)
    reporters = Reporters(TelemetryConfig(heartbeat_interval_s=60.0), "trainer", transport, exporter, beat)
    try:
        reporters.lag = SimpleNamespace(measured_at=50.0, total=8, position_total=2, close=lambda: None)
        assert reporters.lag_gauges() == {"lag/total": 8.0, "lag/position_total": 2.0}
        assert reporters.lag_measured_at == 50.0
    finally:
        reporters.close()
        exporter.close()


# -- the span-free transport -----------------------------------------------------------------------------------------


def test_without_spans_keeps_the_instance_and_drops_the_tracer(tmp_path):
    from stream_rl.config.shared import SharedConfig
    from stream_rl.transport.client import Transport

    cfg = SharedConfig(run_dir=tmp_path, kafka={"bootstrap_servers": "127.0.0.1:9"},
                       tracing={"exporter": "jsonl"})
    transport = Transport(cfg, "producer")
    quiet = transport.without_spans()
    assert quiet.instance_id == transport.instance_id and quiet.names == transport.names
    assert quiet.bootstrap == transport.bootstrap and quiet.cfg is transport.cfg
    assert transport.tracing.records_spans and not quiet.tracing.records_spans
    assert quiet.tracing is not transport.tracing


# -- the composition -------------------------------------------------------------------------------------------------


def test_role_telemetry_judges_a_step_exports_its_row_and_reports_the_alert(tmp_path):
    from stream_rl.telemetry.role import RoleTelemetry

    cfg = SimpleNamespace(telemetry=TelemetryConfig(exporters=["prometheus"], http=False, heartbeat_interval_s=60.0),
                          alerts=AlertsConfig(), run_dir=str(tmp_path))
    transport, alerts_sink = FakeTransport(), FakeSink()
    tel = RoleTelemetry(cfg, "trainer", transport).attach(sink=alerts_sink)
    try:
        tel.set_ready(model_loaded=True, version=2)
        tel.dead_lettered("r.scored", "SchemaError")
        tel.tick()
        assert tel.gauges["dlq/total"] == 1.0 and tel.state == "ready"
        tel.step_done(3, {"loss/total": 0.5})
        with pytest.raises(AlertStop):
            tel.step_done(4, {"loss/total": math.nan})
        tel.row_written({"step": 4, "time": 1e9, "loss/total": math.nan, "reward/mean": 0.25},
                        {"loss/total": math.nan, "reward/mean": 0.25})
        text = tel.exporter.metrics.prometheus_text().decode()
        assert 'name="reward/mean"' in text and 'name="time"' not in text and 'name="loss/total"' not in text
        assert 'stream_rl_alerts_firing{instance_id="trainer-0badc0de",name="loss_nonfinite",role="trainer"} 1.0' \
            in text
        assert 'stream_rl_trainer_step{instance_id="trainer-0badc0de",role="trainer"} 4.0' in text
        assert [a.name for _, a, _ in alerts_sink.sent if isinstance(a, Alert)] == ["loss_nonfinite"]
    finally:
        tel.close()
    last = transport.heartbeat_sink.sent[-1][1]
    assert last.state == "stopping" and last.step == 4 and last.open_alerts == ["loss_nonfinite"]
    assert last.metrics["reward/mean"] == 0.25 and "loss/total" not in last.metrics
    assert last.metrics["dlq/total"] == 1.0 and last.metrics["step"] == 4.0
    tel.close()  # idempotent
