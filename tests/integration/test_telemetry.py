"""Telemetry of the roles: /readyz against a private broker, heartbeats, and lag per partition against hand-computed
values. A running trainer's metrics, heartbeats and JSON-lines file, and its NaN-loss stop, run on the in-process
bus: tests/unit/test_trainer_loop_telemetry.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support.http_get import get
from support.waiting import wait_for

from schemas import Heartbeat
from stream_rl.telemetry.health import HealthSnapshot, liveness, readiness
from stream_rl.telemetry.heartbeat import Beat, finite_metrics, rates
from stream_rl.telemetry.lag import LagMonitor, compute_lag
from stream_rl.transport.client import Transport

torch.set_num_threads(1)


# -- pure parts -----------------------------------------------------------------------------------------------------


def test_lag_rates_and_health_formulas():
    assert compute_lag({("t", 0): 10, ("t", 1): 4, ("t", 2): 7}, {("t", 0): 6, ("t", 1): 9, ("t", 2): -1}) == {
        ("t", 0): 4, ("t", 1): 0, ("t", 2): 7}
    first = Beat(time=100.0, state="ready", policy_version=1, step=2,
                 counts={"records_in": 10, "records_out": 4, "tokens": 50})
    second = Beat(time=102.0, state="ready", policy_version=1, step=3,
                  counts={"records_in": 16, "records_out": 8, "tokens": 150})
    assert rates(None, first) == {"records_in": 0.0, "records_out": 0.0, "tokens": 0.0}
    assert rates(first, second) == {"records_in": 3.0, "records_out": 2.0, "tokens": 50.0}
    assert finite_metrics({"a": 1, "b": math.nan, "c": math.inf, "d": None, "e": True, "f": 2.5}) == {
        "a": 1.0, "f": 2.5}
    snap = HealthSnapshot(last_tick=10.0, broker_ok_at=9.0, model_loaded=True, version=0)
    assert readiness(snap, 12.0, 5.0) == (True, [])
    ok, why = readiness(HealthSnapshot(last_tick=10.0, broker_ok_at=1.0, model_loaded=False, version=-1), 12.0, 5.0)
    assert not ok and len(why) == 3 and why[0].startswith("broker unreachable") and "model not loaded" in why
    assert liveness(snap, 15.0, 10.0) == (True, [])
    assert liveness(snap, 21.0, 10.0)[0] is False


# -- readiness against a private broker -----------------------------------------------------------------------------


@pytest.mark.broker
def test_readyz_needs_model_version_and_broker(tmp_path):
    from stream_rl import broker as broker_mod
    from stream_rl.cli.config import load_config
    from stream_rl.config.sections import BrokerConfig
    from stream_rl.telemetry.role import RoleTelemetry

    bcfg = BrokerConfig(state_dir=tmp_path / "private-broker")
    state = broker_mod.up(bcfg)
    tel = None
    try:
        cfg = load_config(None, env={}, overrides={
            "kafka.bootstrap_servers": state.bootstrap, "topics.run": "ready", "run_dir": str(tmp_path / "run"),
            "telemetry.heartbeat_interval_s": 0.3})
        transport = Transport(cfg, "producer")
        transport.ensure_topics()
        tel = RoleTelemetry(cfg, "producer", transport)
        url = tel.exporter.server.url
        status, body = get(url + "/readyz")
        assert status == 503 and "model not loaded" in json.loads(body)["not_ready"]
        assert get(url + "/healthz")[0] == 503  # the loop has not ticked yet
        tel.tick()
        assert get(url + "/healthz")[0] == 200
        wait_for(lambda: tel.reporters.heartbeat.sent >= 1, "an acknowledged heartbeat", 30)
        assert json.loads(get(url + "/readyz")[1])["not_ready"] == ["model not loaded", "weights version unknown"]
        tel.set_ready(model_loaded=True, version=0)
        assert get(url + "/readyz") == (200, json.dumps({"ready": True, "not_ready": []}).encode())

        broker_mod.down(bcfg)
        not_ready = wait_for(lambda: get(url + "/readyz")[0] == 503 and json.loads(get(url + "/readyz")[1]),
                             "not ready after the broker stopped", 30)
        assert not_ready["not_ready"][0].startswith("broker unreachable")
        assert get(url + "/healthz")[0] == 200  # alive, just not ready
    finally:
        if tel is not None:
            tel.close()
        broker_mod.down(bcfg)


# -- lag per partition ----------------------------------------------------------------------------------------------


@pytest.mark.broker
def test_lag_per_partition_is_highwater_minus_committed(make_config):
    cfg = make_config()
    transport = Transport(cfg, "test")
    topic = f"{transport.names.prefix}.{transport.names.run}.lagprobe"
    transport.ensure_topics(extra={topic: 3})
    sink = transport.sink()
    for partition, count in ((0, 5), (1, 3), (2, 0)):
        for i in range(count):
            hb = Heartbeat(role="producer", instance_id="producer-x", host="h", pid=1, state="ready",
                           policy_version=0, step=i)
            sink.send(topic, hb, key="producer-x", partition=partition)
    sink.flush()
    group = f"{transport.names.prefix}.{transport.names.run}.lagtest"
    source = transport.source([topic], group, "heartbeat", sink)
    try:
        got = []
        wait_for(lambda: got.extend(source.poll(0.5)) or len(got) >= 8, "8 records", 60)
        tps = {partition: (topic, partition) for topic, partition in source.assignment()}
        assert source.commit({tps[0]: 2, tps[1]: 3})  # partition 2: no commit
        monitor = LagMonitor(transport, group, [topic], 60.0, lambda *a: None, lambda exc: None)
        monitor.positions.update({(topic, 0): 4})
        try:
            lag, position_lag = monitor.measure()
        finally:
            monitor.close()
            monitor._close_clients()
    finally:
        source.close()
        sink.close()
    assert lag == {(topic, 0): 5 - 2, (topic, 1): 3 - 3, (topic, 2): 0}
    assert position_lag == {(topic, 0): 5 - 4, (topic, 1): 0, (topic, 2): 0}
