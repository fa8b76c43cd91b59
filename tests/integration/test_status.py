"""`stream-rl status`: the pure snapshot (heartbeat fold, staleness, throughput, lag, alert fold) against
hand-computed values, the CLI's `--once --json` on the real broker, and the span attributes of rollouts (numbers,
never text)."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from support import messages as samples
from typer.testing import CliRunner

from schemas import Alert, GatewayEpisode, Heartbeat
from stream_rl.cli.main import app
from stream_rl.operator_tools.status import build_snapshot, lag_rows, open_alerts, topic_rows
from stream_rl.transport.span_attributes import span_attributes

NOW = 1_000_000.0


def _hb(role: str, instance: str, age_s: float, version: int, step: int = 0, **kw) -> Heartbeat:
    return Heartbeat(role=role, instance_id=instance, host="h1", pid=7, state="ready", policy_version=version,
                     step=step, interval_s=5.0, created_at=NOW - age_s, **kw)


def _alert(name: str, state: str, at: float, instance: str = "trainer-a") -> Alert:
    return Alert(name=name, state=state, action="log", role="trainer", instance_id=instance,
                 message=f"{name} crossed", value=2.0, threshold=1.0, created_at=at)


def test_snapshot_folds_heartbeats_and_computes_staleness():
    manifest, _ = samples.weights(version=7)
    manifest = replace(manifest, created_at=NOW - 4.0)
    heartbeats = [
        _hb("trainer", "trainer-a", 12.0, 6, step=60, metrics={"loss": 0.5}),
        _hb("trainer", "trainer-a", 1.0, 7, step=70, metrics={"loss": 0.25, "reward/mean": 0.75}),  # newest
        _hb("producer", "producer-a", 2.0, 5, rates={"records_out": 12.5}),
        _hb("producer", "producer-b", 15.5, 4),  # 15.5 s > 3 x 5 s: missing
        _hb("scorer", "scorer-a", 15.0, -1),  # exactly 3 intervals: still alive
    ]
    snap = build_snapshot(run="r", now=NOW, heartbeats=heartbeats, manifest=manifest, marks={})
    rows = {r["instance_id"]: r for r in snap["roles"]}
    assert [r["instance_id"] for r in snap["roles"]] == ["producer-a", "producer-b", "scorer-a", "trainer-a"]
    assert rows["trainer-a"]["step"] == 70 and rows["trainer-a"]["age_s"] == 1.0
    assert {k: r["status"] for k, r in rows.items()} == {
        "producer-a": "alive", "producer-b": "missing", "scorer-a": "alive", "trainer-a": "alive"}
    assert rows["producer-a"]["staleness"] == 2 and rows["producer-b"]["staleness"] == 3  # 7 - 5, 7 - 4
    assert rows["scorer-a"]["staleness"] is None and rows["trainer-a"]["staleness"] is None
    assert rows["producer-a"]["rates"] == {"records_out": 12.5}
    assert snap["weights"] == {"version": 7, "step": 10, "mode": "inline", "total_bytes": 24, "age_s": 4.0}
    assert snap["trainer_metrics"] == {"loss": 0.25, "reward/mean": 0.75}
    # no manifest yet: the newest live trainer heartbeat's version
    no_manifest = build_snapshot(run="r", now=NOW, heartbeats=heartbeats, manifest=None, marks={})
    assert no_manifest["weights"]["version"] == 7
    assert {r["instance_id"]: r["staleness"] for r in no_manifest["roles"]}["producer-a"] == 2
    assert build_snapshot(run="r", now=NOW, heartbeats=[], manifest=None, marks={})["weights"] is None


def test_throughput_lag_and_alert_fold():
    topics = topic_rows({"rollouts": [10, 30], "status": [4]}, {"rollouts": [4, 20], "status": [4]}, 2.0)
    assert topics["rollouts"] == {"partitions": 2, "records": 40, "highwaters": [10, 30], "records_per_s": 8.0}
    assert topics["status"]["records_per_s"] == 0.0
    assert topic_rows({"status": [4]}, None, None)["status"]["records_per_s"] is None
    lag = lag_rows({"rollouts": [10, 30, 5]}, {"g.scorers": {0: 10, 1: 21}}, {"g.scorers": "rollouts",
                                                                              "g.trainer": "scored"})
    assert lag == {"g.scorers": {"topic": "rollouts", "total": 14, "partitions": [
        {"partition": 0, "highwater": 10, "committed": 10, "lag": 0},
        {"partition": 1, "highwater": 30, "committed": 21, "lag": 9},
        {"partition": 2, "highwater": 5, "committed": None, "lag": 5}]}}
    alerts = open_alerts([_alert("lag", "firing", 10.0), _alert("lag", "resolved", 20.0),
                          _alert("nan_loss", "firing", 15.0), _alert("lag", "firing", 12.0, "trainer-b"),
                          _alert("rss", "resolved", 5.0), _alert("rss", "firing", 30.0)])
    assert [(a["instance_id"], a["name"], a["since"]) for a in alerts] == [
        ("trainer-b", "lag", 12.0), ("trainer-a", "nan_loss", 15.0), ("trainer-a", "rss", 30.0)]


def test_span_attributes_carry_numbers_never_text():
    rollout = replace(samples.rollout(2, sample=1, version=3), prompt_text="PROMPT-SENTINEL",
                      response_text="RESPONSE-SENTINEL", answer="ANSWER-SENTINEL", metadata={"m": "META-SENTINEL"})
    attrs = span_attributes(rollout)
    assert attrs == {"stream_rl.rollout_id": "p2:0:1", "stream_rl.group_id": "p2:0",
                     "stream_rl.policy_version.min": 3, "stream_rl.policy_version.max": 3,
                     "stream_rl.prompt_tokens": 4, "stream_rl.response_tokens": 5}
    scored = replace(samples.scored(2, 1), rollout=rollout, reward=0.5)
    assert span_attributes(scored) == {**attrs, "stream_rl.reward": 0.5}
    assert "SENTINEL" not in json.dumps([attrs, span_attributes(scored)])
    assert span_attributes(samples.prompt()) == {}


@pytest.mark.broker
def test_consumer_groups_come_from_one_table(make_config, run_name):
    from consumers.scorer.scorer import scorer_group
    from consumers.trainer.trainer import trainer_group
    from stream_rl.transport.topics import CONSUMER_GROUPS, TopicNames

    cfg = make_config()
    names = TopicNames.from_config(cfg.topics)
    assert scorer_group(cfg) == names.group("scorers") == f"{cfg.topics.prefix}.{run_name}.scorers"
    assert trainer_group(cfg) == names.group("trainer") == f"{cfg.topics.prefix}.{run_name}.trainer"
    assert CONSUMER_GROUPS == {"producers": "prompts", "scorers": "rollouts", "trainer": "scored"}
    with pytest.raises(ValueError, match="unknown consumer group 'scorer'"):
        names.group("scorer")


def test_status_once_json_reads_the_run_topics(make_config, run_name, broker):
    from consumers.scorer.scorer import scorer_group
    from stream_rl.transport.client import Transport

    cfg = make_config(**{"topics.partitions": {"prompts": 1, "rollouts": 3, "scored": 1, "weights": 1, "dlq": 1,
                                               "stale": 1, "status": 1, "alerts": 1}})
    transport = Transport(cfg, "trainer")
    transport.ensure_topics()
    sink = transport.sink()
    now = time.time()
    for role, instance, version, age in (("trainer", "trainer-t1", 4, 0.5), ("producer", "producer-p1", 3, 1.0),
                                         ("scorer", "scorer-s1", 4, 1.0), ("producer", "producer-gone", 1, 60.0)):
        sink.send(transport.names.status, replace(_hb(role, instance, 0.0, version, step=9),
                                                  created_at=now - age), key=instance)
    gateway_counts = {"gateway/episodes_open": 2.0, "gateway/episodes_ended": 1.0, "gateway/episodes_published": 5.0,
                      "gateway/episodes_dead_lettered": 1.0, "gateway/calls": 17.0, "gateway/tokens": 340.0,
                      "gateway/dropped_clients": 1.0, "gateway/refused_connections": 2.0}
    sink.send(transport.names.status, replace(_hb("gateway", "gateway-g1", 0.0, 3, step=17, metrics={
        **gateway_counts, "loop/tick_age_s": 0.1}), created_at=now - 1.0), key="gateway-g1")
    manifest, _ = samples.weights(version=4)
    sink.send(transport.names.weights, replace(manifest, created_at=now), key="4")
    sink.send(transport.names.alerts, replace(_alert("consumer_lag", "firing", now - 3), instance_id="trainer-t1"))
    sink.send(transport.names.alerts, replace(_alert("consumer_lag", "resolved", now - 2), instance_id="trainer-t1"))
    sink.send(transport.names.alerts, replace(_alert("loss_nonfinite", "firing", now - 1), instance_id="trainer-t1"))
    sink.send(transport.names.gateway, GatewayEpisode(episode_id="e1", outcome="ended", reward=1.0, reason="",
                                                      calls=1), key="e1")
    for partition, count in ((0, 3), (1, 2), (2, 1)):
        for i in range(count):
            sink.send(transport.names.rollouts, samples.rollout(partition * 10 + i),
                      key=samples.rollout(partition * 10 + i).group_id, partition=partition)
    sink.flush()
    source = transport.source([transport.names.rollouts], scorer_group(cfg), "rollout", sink)
    seen, deadline = [], time.monotonic() + 30
    while len(seen) < 6 and time.monotonic() < deadline:
        seen += source.poll(0.5)
    assert len(seen) == 6
    tps = {partition: (topic, partition) for topic, partition in source.assignment()}
    assert source.commit({tps[0]: 2, tps[1]: 2})  # partition 2: nothing committed
    source.close()
    sink.close()

    result = CliRunner().invoke(app, ["status", "--once", "--json", "--bootstrap", broker.bootstrap,
                                      "--run", run_name, "--interval", "0.2"])
    assert result.exit_code == 0, result.output
    snap = json.loads(result.stdout)
    roles = {r["instance_id"]: (r["role"], r["status"], r["staleness"]) for r in snap["roles"]}
    assert roles == {"trainer-t1": ("trainer", "alive", None), "producer-p1": ("producer", "alive", 1),
                     "scorer-s1": ("scorer", "alive", None), "producer-gone": ("producer", "missing", 3),
                     "gateway-g1": ("gateway", "alive", 1)}
    assert snap["gateways"] == {"gateway-g1": gateway_counts}
    assert snap["weights"]["version"] == 4
    assert snap["topics"]["rollouts"]["highwaters"] == [3, 2, 1] and snap["topics"]["status"]["records"] == 5
    assert snap["topics"]["rollouts"]["records_per_s"] == 0.0
    assert snap["topics"]["gateway"]["partitions"] == 1 and snap["topics"]["gateway"]["records"] == 1
    lag = snap["lag"][f"{cfg.topics.prefix}.{run_name}.scorers"]
    assert [p["lag"] for p in lag["partitions"]] == [1, 0, 1] and lag["total"] == 2
    assert [p["committed"] for p in lag["partitions"]] == [2, 2, None]
    assert snap["lag"][f"{cfg.topics.prefix}.{run_name}.producers"]["total"] == 0
    assert [a["name"] for a in snap["alerts"]] == ["loss_nonfinite"]
    table = CliRunner().invoke(app, ["status", "--once", "--bootstrap", broker.bootstrap, "--run", run_name,
                                     "--interval", "0.1"])
    assert table.exit_code == 0, table.output
    assert "producer-gone" in table.stdout and "missing" in table.stdout and "loss_nonfinite" in table.stdout
    gateway_row = next(line for line in table.stdout.splitlines() if "gateway-g1" in line and "340" in line)
    assert [cell.strip() for cell in gateway_row.strip(" │|").split("│")][1:] == ["2", "1", "5", "1", "17", "340", "1", "2"]


def test_status_exits_1_with_one_line_when_the_broker_is_unreachable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no run directories here: the broker is asked for its runs, and cannot answer
    result = CliRunner().invoke(app, ["status", "--once", "--json", "--bootstrap", "127.0.0.1:1"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "127.0.0.1:1" in lines[0] and "unreachable" in lines[0]


def test_endpoint_rows_mark_a_dead_pid_stale_and_data_progress_comes_from_the_trainer_metrics():
    from stream_rl.operator_tools.status import data_progress, endpoint_rows

    records = [{"role": "trainer", "instance_id": "trainer-a", "url": "http://127.0.0.1:1", "pid": 11, "host": "h1"},
               {"role": "producer", "instance_id": "producer-a", "url": "http://127.0.0.1:2", "pid": 12, "host": "h1"},
               {"role": "scorer", "instance_id": "scorer-a", "url": "http://10.0.0.2:3", "pid": 11, "host": "h2"}]
    rows = endpoint_rows(records, "h1", lambda pid: pid == 11)
    assert [(r["instance_id"], r["process"]) for r in rows] == [
        ("producer-a", "stale"), ("scorer-a", "unknown"), ("trainer-a", "running")]
    assert data_progress({"data/epoch": 1.0, "data/distinct_prompts": 37.0, "loss": 0.5}) == {
        "epoch": 1, "distinct_prompts": 37}
    assert data_progress({"loss": 0.5}) == {"epoch": None, "distinct_prompts": None}
    snap = build_snapshot(run="r", now=NOW, manifest=None, marks={}, endpoints=rows, heartbeats=[
        _hb("trainer", "trainer-a", 1.0, 2, metrics={"data/epoch": 0.0, "data/distinct_prompts": 5.0})])
    assert snap["data"] == {"epoch": 0, "distinct_prompts": 5} and snap["endpoints"] == rows


def _read_lines(stream, into: list[str]) -> None:
    for line in stream:
        into.append(line)


@pytest.mark.broker
def test_status_shows_stale_endpoints_and_data_progress_and_prints_plain_text_when_piped(make_config, run_name,
                                                                                         broker, tmp_path):
    import os
    import signal
    import socket
    import subprocess
    import sys
    import threading

    from stream_rl.transport.client import Transport

    cfg = make_config(**{"topics.partitions": {"status": 1}})
    transport = Transport(cfg, "trainer")
    transport.ensure_topics()
    sink = transport.sink()
    sink.send(transport.names.status, replace(_hb("trainer", "trainer-t1", 0.0, 3, step=9, metrics={
        "data/epoch": 1.0, "data/distinct_prompts": 37.0}), created_at=time.time(), interval_s=60.0),
        key="trainer-t1")
    sink.flush()
    sink.close()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid is not running any more: the role died without removing its endpoint file
    endpoints = tmp_path / "run" / "endpoints"
    endpoints.mkdir(parents=True)
    for instance, pid in (("trainer-t1", os.getpid()), ("producer-dead", gone.pid)):
        (endpoints / f"{instance}.json").write_text(json.dumps({
            "role": instance.split("-")[0], "instance_id": instance, "url": "http://127.0.0.1:9", "pid": pid,
            "host": socket.gethostname()}))
    args = ["status", "--bootstrap", broker.bootstrap, "--run", run_name, "--set", f"run_dir={tmp_path / 'run'}"]

    snap = json.loads(CliRunner().invoke(app, [*args, "--once", "--json", "--interval", "0.1"]).stdout)
    assert {e["instance_id"]: e["process"] for e in snap["endpoints"]} == {"producer-dead": "stale",
                                                                           "trainer-t1": "running"}
    assert snap["data"] == {"epoch": 1, "distinct_prompts": 37}

    # without --once and without a terminal: plain snapshots, one per refresh, until Ctrl-C (exit 0)
    proc = subprocess.Popen([sys.executable, "-m", "stream_rl.cli.main", *args, "--interval", "0.3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    deadline = time.monotonic() + 40
    while sum(x.startswith("--- stream-rl status") for x in lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 0
    out = "".join(lines)
    assert out.count("--- stream-rl status") >= 2, out[-2000:]
    assert f"run {run_name}" in out and "epoch 1  distinct prompts 37" in out
    assert "producer-dead" in out and "stale" in out and "\x1b[" not in out  # no terminal codes in a pipe
