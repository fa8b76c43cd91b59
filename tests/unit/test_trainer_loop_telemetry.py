"""Telemetry of a running trainer on the in-process bus (``memory://``): Prometheus metrics over HTTP, heartbeats,
the JSON-lines metrics file, and a NaN loss stopping it before any NaN weights are published.
(Moved from tests/integration/test_telemetry.py, same assertions.)"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from support.http_get import get
from support.topics import heartbeats, read_values
from support.trainer import scored, tiny_policy
from support.waiting import wait_for

from stream_rl.transport.client import Transport

torch.set_num_threads(1)


def samples(text: bytes) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


def pick(found: dict, metric: str, **labels) -> list[float]:
    want = set(labels.items())
    return [v for (n, lbls), v in found.items() if n == metric and want <= lbls]


def measurements_since(lag, since: float, count: int):
    """A condition: ``count`` lag measurements (:class:`~stream_rl.telemetry.lag.LagMonitor`) finished after
    ``since``. Each measurement begins after the previous one's gauges are set, so a scrape after the third shows
    one that began after ``since`` (the first may have begun before; the bus is fast enough to show it)."""
    seen: set[float] = set()

    def done() -> bool:
        if lag.measured_at is not None and lag.measured_at > since:
            seen.add(lag.measured_at)
        return len(seen) >= count

    return done


# -- a running trainer ----------------------------------------------------------------------------------------------


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
    trainer = Trainer(cfg, cfg.trainer)
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

        wait_for(lambda: trainer.state.version == 2, "step 2's weights published", 30)
        wait_for(measurements_since(trainer.telemetry.reporters.lag, time.time(), 3), "3 lag measurements", 30,
                 interval_s=0.05)  # the 2nd began after step 2 and its gauges are set once the 3rd is done
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
        # the trainer commits its safe offsets after every step (issue 45.1): committed lag 0, position lag 0
        group = f"{cfg.topics.prefix}.{cfg.topics.run}.trainer"
        assert pick(found, "stream_rl_consumer_lag_records", group=group, topic=feeder.names.scored,
                    partition="0", **base) == [0.0]
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


# -- a stop alert in the trainer ------------------------------------------------------------------------------------


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
    trainer = loop_mod.Trainer(cfg, cfg.trainer)
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
