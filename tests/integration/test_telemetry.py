"""Telemetry of the roles: Prometheus metrics of a running trainer, /readyz against a private broker, heartbeats,
the JSON-lines metrics file, and lag per partition against hand-computed values."""

from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from support.topics import heartbeats, read_values
from support.trainer import scored, tiny_policy
from support.waiting import wait_for

from schemas import Heartbeat
from stream_rl.telemetry.health import HealthSnapshot, liveness, readiness
from stream_rl.telemetry.heartbeat import Beat, finite_metrics, rates
from stream_rl.telemetry.lag import LagMonitor, compute_lag
from stream_rl.transport.client import Transport

torch.set_num_threads(1)


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def samples(text: bytes) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


def pick(found: dict, metric: str, **labels) -> list[float]:
    want = set(labels.items())
    return [v for (n, lbls), v in found.items() if n == metric and want <= lbls]


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


# -- a running trainer ----------------------------------------------------------------------------------------------


@pytest.mark.broker
def test_running_trainer_serves_metrics_heartbeats_and_jsonl(make_config, tmp_path):
    from consumers.trainer.trainer import Trainer
    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models import save_model

    model_dir = save_model(tiny_policy(seed=0), build_tokenizer(), tmp_path / "policy")
    cfg = make_config(**{"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 2,
                         "trainer.micro_batch_size": 2, "trainer.poll_timeout_s": 0.2, "trainer.max_lag": 4,
                         "topics.partitions.scored": 1, "telemetry.exporters": ["jsonl", "prometheus"],
                         "telemetry.heartbeat_interval_s": 0.5, "telemetry.lag_interval_s": 0.5,
                         "telemetry.export_interval_s": 1.0})
    trainer = Trainer(cfg)
    tel_id = trainer.telemetry.instance_id
    endpoint = json.loads((Path(cfg.run_dir) / "endpoints" / f"{tel_id}.json").read_text())
    assert endpoint["role"] == "trainer" and endpoint["url"].startswith("http://127.0.0.1:")
    feeder = Transport(cfg, "test")
    sink = feeder.sink()
    for p in range(4):  # 4 groups x 2 samples x 2 response tokens; 2 groups per step -> 2 steps
        for s in range(2):
            rec = scored(p, s, version=0, reward=float(s == 0), response_ids=[6 + s, 7])
            sink.send(feeder.names.scored, rec, key=rec.group_id)
    sink.flush()
    stop = threading.Event()
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        def scraped():  # lag is measured on its own thread: wait until it saw the consumed records
            status, body = get(endpoint["url"] + "/metrics")
            found = samples(body) if status == 200 else {}
            pos = pick(found, "stream_rl_consumer_position_lag_records", partition="0")
            done = pick(found, "stream_rl_policy_version") == [2.0]  # step 2's weights published
            return found if pos == [0.0] and done else None

        found = wait_for(scraped, "position lag 0", 30)
        base = {"role": "trainer", "instance_id": tel_id}
        assert pick(found, "stream_rl_trainer_step", **base) == [2.0]
        assert pick(found, "stream_rl_policy_version", **base) == [2.0]
        assert pick(found, "stream_rl_records_in_total", topic=feeder.names.scored, **base) == [8.0]
        assert pick(found, "stream_rl_tokens_total", **base) == [16.0]  # 8 rollouts x 2 response tokens
        assert pick(found, "stream_rl_process_rss_bytes", **base)[0] > 10e6
        # staleness: step 1 trains 4 rollouts of v0 at v0 (0), step 2 trains 4 of v0 at v1 (1 each)
        assert pick(found, "stream_rl_staleness_versions_count", **base) == [8.0]
        assert pick(found, "stream_rl_staleness_versions_sum", **base) == [4.0]
        assert pick(found, "stream_rl_processing_seconds_count", stage="train", **base) == [2.0]
        # the trainer commits at checkpoints only (none yet): committed lag 8, position lag 0
        group = f"{cfg.topics.prefix}.{cfg.topics.run}.trainer"
        assert pick(found, "stream_rl_consumer_lag_records", group=group, topic=feeder.names.scored,
                    partition="0", **base) == [8.0]
        assert pick(found, "stream_rl_trainer_metric", name="reward/mean", **base) == [0.5]
        assert pick(found, "stream_rl_trainer_metric", name="loss/total", **base)
        assert pick(found, "stream_rl_records_out_total", **base)  # weights manifests and chunks
        assert get(endpoint["url"] + "/readyz")[0] == 200 and get(endpoint["url"] + "/healthz")[0] == 200
        wait_for(lambda: trainer.telemetry.reporters.heartbeat.sent >= 2, "heartbeats")
    finally:
        stop.set()
        thread.join(60)
        trainer.close()
    sink.close()

    mine = heartbeats(feeder, tel_id)
    assert mine and all(b.role == "trainer" for b in mine)
    assert mine[-1].state == "stopping" and mine[-1].policy_version == 2 and mine[-1].step == 2
    assert mine[-1].metrics["reward/mean"] == 0.5 and mine[-1].metrics["process/rss_bytes"] > 10e6
    lines = (Path(cfg.run_dir) / "telemetry" / f"{tel_id}.jsonl").read_text().splitlines()
    last = {m["name"]: m for m in json.loads(lines[-1])["metrics"]}
    assert last["stream_rl_trainer_step"]["points"][0]["value"] == 2.0
    assert last["stream_rl_tokens_total"]["points"][0]["value"] == 16.0


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


# -- a stop alert in the trainer ------------------------------------------------------------------------------------


@pytest.mark.broker
def test_nan_loss_stops_trainer_before_weights_are_published(make_config, tmp_path, monkeypatch):
    import consumers.trainer.trainer as loop_mod
    from stream_rl.alerts.monitor import AlertStop
    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models import save_model

    real_step = loop_mod.train_step

    def poisoned(engine, batch, tcfg, state):  # step 2 blows up: NaN loss and NaN weights
        metrics = real_step(engine, batch, tcfg, state)
        if state.step == 2:
            with torch.no_grad():
                next(engine.module.parameters()).fill_(float("nan"))
            metrics["loss/total"] = float("nan")
        return metrics

    monkeypatch.setattr(loop_mod, "train_step", poisoned)
    model_dir = save_model(tiny_policy(seed=0), build_tokenizer(), tmp_path / "policy")
    cfg = make_config(**{"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 1,
                         "trainer.micro_batch_size": 2, "trainer.poll_timeout_s": 0.2, "trainer.checkpoint_every": 1,
                         "topics.partitions.scored": 1, "telemetry.heartbeat_interval_s": 0.5})
    feeder = Transport(cfg, "test")
    feeder.ensure_topics()
    sink = feeder.sink()
    for p in range(3):
        for s in range(2):
            rec = scored(p, s, version=0, reward=float(s == 0), response_ids=[6 + s, 7])
            sink.send(feeder.names.scored, rec, key=rec.group_id)
    sink.flush()
    sink.close()
    trainer = loop_mod.Trainer(cfg)
    try:
        with pytest.raises(AlertStop) as info:
            trainer.run(threading.Event())
    finally:
        trainer.close()
    assert info.value.alert.name == "loss_nonfinite" and info.value.exit_code == 3
    assert trainer.state.step == 2 and trainer.state.version == 1  # step 2's weights were never published
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["loss/total"] is None
    ckpts = sorted(p.name for p in (Path(cfg.run_dir) / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert ckpts == ["step-00000001"]  # step 1's; the NaN step did not become the newest checkpoint
    alerts = read_values(feeder, feeder.names.alerts, "alert")
    assert [(a.name, a.state, a.action) for a in alerts if a.name == "loss_nonfinite"] == [
        ("loss_nonfinite", "firing", "stop")]
