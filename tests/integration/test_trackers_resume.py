"""Experiment trackers across a kill -9 and a resume, for each tracker, and W&B offline: the parts that start
another process (the killed stand-in of a trainer, W&B's service). Everything is read back with each library's own
reader (tests/support/trackers.py) and compared with ``metrics.jsonl``; the last test resumes a real trainer on the
real broker and checks every tracker holds each step once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO_ROOT
from support.trackers import READERS, every_file_bytes, read_back, wandb_records

from consumers.trainer.history import append_line, truncate_steps
from stream_rl.cli.config import load_config
from stream_rl.telemetry.trackers.fanout import Trackers

TRACKERS = ["tensorboard", "mlflow", "wandb"]
KILLED = """
import json, os, signal, sys, time
from pathlib import Path
from consumers.trainer.history import append_line
from stream_rl.cli.config import load_config
from stream_rl.telemetry.trackers.fanout import Trackers
args = json.loads(sys.argv[1])
cfg = load_config(None, env={}, overrides=args["overrides"])
trackers = Trackers.open(cfg, None)
for row in args["rows"]:
    append_line(Path(cfg.run_dir) / "metrics.jsonl", row)
    if row["step"] <= args["log_through"]:
        trackers.log_step(row)
state, deadline = Path(cfg.run_dir) / "trackers" / (args["name"] + ".json"), time.time() + 60
while time.time() < deadline:
    try:
        if json.loads(state.read_text())["logged_step"] == args["log_through"]:
            break
    except (OSError, ValueError, KeyError):
        pass
    time.sleep(0.05)
time.sleep(args["settle_s"])  # W&B's service writes its file after log() returns
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    """No W&B key and no mode: the tracker must choose offline itself."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)


def overrides(tmp_path: Path, trackers: list[str]) -> dict:
    return {"run_dir": str(tmp_path / "run"), "topics.run": "resume-run", "telemetry.trackers": trackers,
            "telemetry.tracker_retry_s": 0.05}


def row(step: int, scale: float = 1.0) -> dict:
    return {"step": step, "policy_version": step, "time": 1e9 + step, "reward/mean": scale * (0.25 + step / 16),
            "loss/policy": scale * step / 8}


def rows_of(path: Path) -> dict[int, dict]:
    return {json.loads(x)["step"]: json.loads(x) for x in path.read_text().splitlines()}


@pytest.mark.slow
@pytest.mark.parametrize("name", TRACKERS)
@pytest.mark.parametrize(("log_through", "kept_first"), [(7, {6, 7}), (3, set())], ids=["ahead", "behind"])
def test_kill_9_then_resume_logs_every_step_once(tmp_path, name, log_through, kept_first):
    """A process logs steps 1..log_through (metrics.jsonl has 1..7: the rest died in its queue) and is killed -9;
    the trainer resumes from its step-5 checkpoint (metrics.jsonl truncated to 5) and trains 6..9 again with other
    values. Each tracker then holds steps 1..9 once; steps up to 5 equal metrics.jsonl; TensorBoard (which purges)
    shows the new 6..9; MLflow and W&B keep the first values of the steps they still held (6, 7 when ahead; W&B
    offline loses what its service had buffered at the kill: those steps come from metrics.jsonl or the resumed
    training)."""
    args = {"overrides": overrides(tmp_path, [name]), "rows": [row(s) for s in range(1, 8)],
            "log_through": log_through, "name": name, "settle_s": 2.0 if name == "wandb" else 0.0}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_TRACKING"))}
    done = subprocess.run([sys.executable, "-c", KILLED, json.dumps(args)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == -9, done.stderr[-2000:]
    held = READERS[name](tmp_path / "run" / "trackers").get("reward/mean", {})  # what survived the kill
    if name != "wandb":  # written synchronously; W&B's service buffers its file and dies with the process
        assert sorted(held) == list(range(1, log_through + 1))
    metrics = tmp_path / "run" / "metrics.jsonl"
    truncate_steps(metrics, 5)
    cfg = load_config(None, env={}, overrides=overrides(tmp_path, [name]))
    trackers = Trackers.open(cfg, resume_step=5)
    for s in range(6, 10):
        append_line(metrics, row(s, scale=2.0))
        trackers.log_step(row(s, scale=2.0))
    trackers.close()
    got, final = read_back(name, tmp_path / "run" / "trackers")["reward/mean"], rows_of(metrics)
    assert {s: len(v) for s, v in got.items()} == {s: 1 for s in range(1, 10)}
    kept = kept_first & set(held) if name != "tensorboard" else set()
    for step, [value] in got.items():
        expected = row(step)["reward/mean"] if step in kept else final[step]["reward/mean"]
        assert value == pytest.approx(expected, rel=1e-6), step


def test_wandb_offline_without_a_key_matches_metrics_jsonl_masks_secrets_and_redacts_samples(tmp_path, monkeypatch):
    from support.messages import scored

    monkeypatch.setenv("STREAM_RL_KAFKA__SASL_PASSWORD", "sentinel-sasl-do-not-log")
    cfg = load_config(None, overrides={**overrides(tmp_path, ["wandb"]), "telemetry.log_samples": 4})
    trackers = Trackers.open(cfg, None)
    metrics = tmp_path / "run" / "metrics.jsonl"
    for s in range(1, 5):
        append_line(metrics, row(s))
        trackers.log_step(row(s), [scored(i) for i in range(2)])
    trackers.log_evaluation(2, {"eval/held/accuracy": 0.5}, version=1)
    trackers.close()
    directory = tmp_path / "run" / "trackers"
    assert list((directory / "wandb").glob("offline-run-*"))  # offline: no key, no mode set
    got, final = read_back("wandb", directory), rows_of(metrics)
    assert {s: v for s, [v] in got["reward/mean"].items()} == pytest.approx(
        {s: final[s]["reward/mean"] for s in range(1, 5)})
    assert got["eval/held/accuracy"] == {4: [0.5]} and got["eval/step"] == {4: [2.0]}  # x-axis: eval/step
    config = [r for r in wandb_records(directory) if r.WhichOneof("record_type") == "config"]
    items = {u.key: json.loads(u.value_json) for r in config for u in r.config.update}
    assert items["kafka.sasl_password"] == "**********" and items["topics.run"] == "resume-run"
    assert b"sentinel-sasl-do-not-log" not in every_file_bytes(tmp_path / "run")
    [table] = (directory / "wandb").glob("offline-run-*/files/media/table/samples_4_*.table.json")  # step 4 only
    assert json.loads(table.read_text())["data"] == [[4, "#0", "<redacted: 4 chars>", "<redacted: 15 chars>", 1.0,
                                                      "stop"], [4, "#1", "<redacted: 4 chars>",
                                                                "<redacted: 15 chars>", 1.0, "stop"]]
    assert b"SECRET-RESPONSE" not in every_file_bytes(tmp_path / "run")


@pytest.mark.broker
@pytest.mark.slow
def test_real_trainer_resume_continues_each_tracker_run(make_config, model_dir):
    """The trainer writes steps 1..3 (checkpoints at 2 and 3); the step-3 checkpoint is removed, as if it died
    before writing it; the resumed trainer trains step 3 again. Every tracker holds steps 1..3 once, in one run."""
    import torch
    from support.trainer_loop import finish, metric_rows, send_groups, start
    from support.waiting import wait_for

    from stream_rl.transport.client import Transport

    torch.set_num_threads(1)
    cfg = make_config(**{"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 2,
                         "trainer.max_steps": 3, "trainer.checkpoint_every": 2, "trainer.max_lag": 4,
                         "trainer.micro_batch_size": 2, "trainer.poll_timeout_s": 0.2,
                         "topics.partitions.scored": 1, "telemetry.trackers": TRACKERS,
                         "telemetry.tracker_retry_s": 0.05})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    send_groups(transport, sink, [0, 1], version=0)
    run = start(cfg)
    wait_for(lambda: len(metric_rows(cfg)) >= 1, "step 1")
    send_groups(transport, sink, [2, 3], version=1)
    wait_for(lambda: len(metric_rows(cfg)) >= 2, "step 2")
    send_groups(transport, sink, [4, 5], version=2)
    finish(*run)
    first = {r["step"]: r for r in metric_rows(cfg)}
    directory = Path(cfg.run_dir) / "trackers"
    run_ids = {n: json.loads((directory / f"{n}.json").read_text())["run_id"] for n in TRACKERS}
    shutil.rmtree(Path(cfg.run_dir) / "checkpoints" / "step-00000003")
    finish(*start(cfg, resume=True))
    sink.close()
    final = {r["step"]: r for r in metric_rows(cfg)}
    assert sorted(final) == [1, 2, 3]
    for name in TRACKERS:
        assert json.loads((directory / f"{name}.json").read_text())["run_id"] == run_ids[name]
        got = read_back(name, directory)
        for key in ("reward/mean", "time/step_s"):  # the step's wall time differs between the two trainings of 3
            assert {s: len(v) for s, v in got[key].items()} == {1: 1, 2: 1, 3: 1}, (name, key)
            for step, [value] in got[key].items():
                source = first if (name != "tensorboard" and step == 3) else final
                assert value == pytest.approx(source[step][key], rel=1e-6), (name, key, step)
    assert first[3]["time/step_s"] != final[3]["time/step_s"]


def test_trainer_import_loads_no_tracker_library():
    code = ("import sys, consumers.trainer.trainer, stream_rl.cli.config; "
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
