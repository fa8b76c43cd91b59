"""Experiment trackers without a broker and without another process: the pure rules, the config check, TensorBoard
and MLflow (file store) written through the real fan-out and read back with their own readers (evaluations from
the evals topic on the in-process bus), an unreachable MLflow server, secrets and sample redaction, and the lazy
imports (read from the source). W&B starts a service process, the kill -9 resume and the import check of a fresh
interpreter start processes: those are in tests/integration/test_trackers_resume.py."""

from __future__ import annotations

import ast
import json
import logging
import socket
import sys
import time
from pathlib import Path

import pytest
from support.messages import scored
from support.paths import REPO_ROOT
from support.trackers import READERS, every_file_bytes, mlflow_client, mlflow_run_id, tensorboard_texts

from consumers.trainer.history import append_line
from schemas import Evaluation
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError
from stream_rl.evaluation.ledger import Ledger, ensure_evals_topic
from stream_rl.telemetry.trackers import missing_packages
from stream_rl.telemetry.trackers.base import (STEP_KEY, evaluation_metrics, first_step, hyperparams, sample_rows,
                                               scalars)
from stream_rl.telemetry.trackers.fanout import Trackers
from stream_rl.transport.client import Transport

LIBRARIES = ("tensorboard", "wandb", "mlflow")


def config(tmp_path: Path, trackers: list[str], **telemetry):
    return load_config(None, env={}, overrides={"run_dir": str(tmp_path / "run"), "topics.run": "unit-run",
                                                "telemetry.trackers": trackers, "telemetry.tracker_retry_s": 0.05,
                                                **{f"telemetry.{k}": v for k, v in telemetry.items()}})


def row(step: int, scale: float = 1.0) -> dict:
    """A metrics.jsonl row as the trainer writes it (a null, a string-free set of numbers)."""
    return {"step": step, "policy_version": step // 2, "time": 1e9 + step, "loss/policy": scale * step / 8,
            "reward/mean": scale * (0.25 + step / 16), "grad/norm_nonfinite": None, "batcher/ready_groups": 2}


def write_and_log(cfg, steps, scale=1.0, resume_step=None) -> Trackers:
    trackers = Trackers.open(cfg, resume_step)
    for s in steps:
        r = row(s, scale)
        append_line(Path(cfg.run_dir) / "metrics.jsonl", r)
        trackers.log_step(r)
    return trackers


def metrics_jsonl(cfg) -> dict[int, dict]:
    lines = (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
    return {json.loads(x)["step"]: json.loads(x) for x in lines}


# -- pure rules ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("rewinds", "held", "logged", "resume", "expected"), [
    (True, None, 7, 5, 6),     # TensorBoard logged 7, checkpoint 5: purge 6.. and log them again
    (True, None, 3, 5, 4),     # logged 3 only (the queue died with the process): 4, 5 from metrics.jsonl
    (False, 7, 7, 5, 8),       # MLflow holds 7: 6 and 7 keep their first values, never twice
    (False, 3, 7, 5, 4),       # the store lost what the state file claims: the store is believed
    (False, None, 2, 5, 3),    # a backend that cannot tell: the state file
    (True, None, 0, 0, 1),     # a fresh start
])
def test_first_step(rewinds, held, logged, resume, expected):
    assert first_step(rewinds, held, logged, resume) == expected


def test_scalars_keep_finite_numbers_only():
    assert scalars({"step": 3, "time": 1.0, "a": 1, "b": None, "c": float("nan"), "d": "x", "e": 0.5,
                    "f": True}) == {"a": 1.0, "e": 0.5, "f": 1.0}


def test_evaluation_metrics_of_both_row_shapes():
    assert evaluation_metrics({"version": 2, "step": 4, "eval/a/acc": 0.5, "metrics": {"b/pass@8": 1, "eval/c/x": 2,
                                                                                        "d/n": None}}) == {
        "eval/a/acc": 0.5, "eval/b/pass@8": 1.0, "eval/c/x": 2.0}


def test_hyperparams_flatten():
    assert hyperparams({"a": {"b": 1, "c": {"d": None}}, "e": [1, 2], "f": {}}) == {
        "a.b": "1", "a.c.d": "", "e": "[1, 2]", "f": "{}"}


def test_sample_rows_are_redacted_unless_asked():
    s = [scored(i) for i in range(3)]
    rows = sample_rows(s, limit=2, show_content=False)
    assert rows == [{"rollout_id": "#0", "prompt": "<redacted: 4 chars>", "response": "<redacted: 15 chars>",
                     "reward": 1.0, "finish_reason": "stop"},
                    {"rollout_id": "#1", "prompt": "<redacted: 4 chars>", "response": "<redacted: 15 chars>",
                     "reward": 1.0, "finish_reason": "stop"}]
    shown = sample_rows(s, limit=5, show_content=True)
    assert [r["prompt"] for r in shown] == ["0+1=", "1+1=", "2+1="]
    assert shown[0]["response"] == "SECRET-RESPONSE" and shown[0]["rollout_id"] == s[0].rollout.rollout_id


# -- config --------------------------------------------------------------------------------------------------------

def test_missing_tracker_package_is_a_config_error_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec answers None, as for a package not installed
    assert missing_packages(["tensorboard", "wandb"]) == ["tracker wandb (package wandb)"]
    with pytest.raises(ConfigError) as err:
        config(tmp_path, ["tensorboard", "wandb"])
    text = str(err.value)
    assert "telemetry.trackers" in text and "stream-rl[trackers]" in text and "wandb" in text
    assert len(text.splitlines()) == 1


def test_tracker_listed_twice_and_unknown_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="telemetry.trackers: a tracker is listed twice"):
        config(tmp_path, ["mlflow", "mlflow"])
    with pytest.raises(ConfigError, match="telemetry.trackers"):
        config(tmp_path, ["comet"])


# -- round trips -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tensorboard", "mlflow"])
def test_each_step_reaches_the_tracker_as_in_metrics_jsonl(tmp_path, name):
    cfg = config(tmp_path, [name])
    write_and_log(cfg, range(1, 6)).close()
    got, rows = READERS[name](tmp_path / "run" / "trackers"), metrics_jsonl(cfg)
    for key in ("loss/policy", "reward/mean", "batcher/ready_groups", "policy_version", STEP_KEY):
        assert sorted(got[key]) == [1, 2, 3, 4, 5], key
        for step, values in got[key].items():
            expected = rows[step][key] if key != STEP_KEY else step
            assert values == [pytest.approx(expected, rel=1e-6)], (key, step)
    assert "grad/norm_nonfinite" not in got  # null in the row: not a number


@pytest.mark.parametrize("name", ["tensorboard", "mlflow"])
def test_restarted_tracker_object_continues_the_run_once_per_step(tmp_path, name):
    """Close after step 7, resume from a checkpoint at step 5 (metrics.jsonl truncated as the trainer does), steps
    6..9 trained again with other values: every step once; TensorBoard shows the new values (it purges), MLflow
    keeps the values it first held for 6 and 7."""
    from consumers.trainer.history import truncate_steps

    cfg = config(tmp_path, [name])
    write_and_log(cfg, range(1, 8)).close()
    first_run = json.loads((tmp_path / "run" / "trackers" / f"{name}.json").read_text())["run_id"]
    truncate_steps(Path(cfg.run_dir) / "metrics.jsonl", 5)
    write_and_log(cfg, range(6, 10), scale=2.0, resume_step=5).close()
    state = json.loads((tmp_path / "run" / "trackers" / f"{name}.json").read_text())
    assert state["run_id"] == first_run and state["logged_step"] == 9
    got, rows = READERS[name](tmp_path / "run" / "trackers")["reward/mean"], metrics_jsonl(cfg)
    assert sorted(got) == list(range(1, 10)) and all(len(v) == 1 for v in got.values())
    kept_first = {6, 7} if name == "mlflow" else set()
    for step, [value] in got.items():
        expected = row(step)["reward/mean"] if step in kept_first else rows[step]["reward/mean"]
        assert value == pytest.approx(expected, rel=1e-6), step


def evaluation(version: int, step: int, metrics: dict[str, float]) -> Evaluation:
    return Evaluation(version=version, step=step, sets=["held"], metrics=metrics, evaluator_id="evaluator-test")


def test_evaluations_from_the_topic_at_their_step_once_per_version(make_config, tmp_path):
    """The evaluator's ledger publishes on the evals topic (its evals.jsonl is on its own disk); the trainer's run
    dir holds a decoy evals.jsonl no tracker may read. One evaluation is on the topic before the trackers open (the
    backlog), one arrives between steps; a restart reads the whole topic again and logs only the new one."""
    cfg = make_config(**{"telemetry.trackers": ["tensorboard", "mlflow"], "telemetry.tracker_retry_s": 0.05})
    evaluator = Transport(cfg, "evaluator")
    ledger = Ledger(evaluator.sink(), ensure_evals_topic(evaluator), tmp_path / "evaluator-disk")
    Path(cfg.run_dir).mkdir(parents=True)
    append_line(Path(cfg.run_dir) / "evals.jsonl", {"version": 9, "step": 8, "metrics": {"held/accuracy": 0.0}})
    ledger.record(evaluation(1, 2, {"held/accuracy": 0.25, "held/pass@8": 0.5}))
    trainer = Transport(cfg, "trainer")
    trackers = Trackers.open(cfg, None, trainer)
    for s in (1, 2, 3):
        append_line(Path(cfg.run_dir) / "metrics.jsonl", row(s))
        trackers.log_step(row(s))
    ledger.record(evaluation(2, 4, {"held/accuracy": 0.75}))
    append_line(Path(cfg.run_dir) / "metrics.jsonl", row(4))
    trackers.log_step(row(4))
    trackers.close()
    restarted = Trackers.open(cfg, 4, trainer)  # the topic from its start again: versions 1, 2 are not re-logged
    ledger.record(evaluation(3, 6, {"held/accuracy": 1.0}))
    restarted.follow_evaluations()
    restarted.close()
    ledger.sink.close()
    for name in ("tensorboard", "mlflow"):
        got = READERS[name](tmp_path / "run" / "trackers")
        assert got["eval/held/accuracy"] == {2: [0.25], 4: [0.75], 6: [1.0]}, name  # not the decoy's step 8
        pass_at_8 = "eval/held/pass_at_8" if name == "mlflow" else "eval/held/pass@8"  # MLflow refuses "@"
        assert got[pass_at_8] == {2: [0.5]}, name


def test_samples_every_k_steps_redacted(tmp_path):
    cfg = config(tmp_path, ["tensorboard", "mlflow"], log_samples=2, log_sample_rows=3)
    trackers = Trackers.open(cfg, None)
    for s in range(1, 5):
        trackers.log_step(row(s), [scored(i) for i in range(4)])
    trackers.close()
    texts = tensorboard_texts(tmp_path / "run" / "trackers", "samples")
    assert sorted(texts) == [2, 4] and texts[2].count("<redacted: 15 chars>") == 3
    client, run_id = mlflow_client(tmp_path / "run" / "trackers"), mlflow_run_id(tmp_path / "run" / "trackers")
    assert sorted(a.path for a in client.list_artifacts(run_id, "samples")) == [
        "samples/step_00000002.json", "samples/step_00000004.json"]
    rows = json.loads(Path(client.download_artifacts(run_id, "samples/step_00000004.json", str(tmp_path))).read_text())
    assert [r["response"] for r in rows] == ["<redacted: 15 chars>"] * 3
    assert b"SECRET-RESPONSE" not in every_file_bytes(tmp_path / "run" / "trackers")


def test_no_secret_reaches_a_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAM_RL_KAFKA__SASL_PASSWORD", "sentinel-sasl-do-not-log")
    cfg = load_config(None, overrides={"run_dir": str(tmp_path / "run"), "telemetry.trackers": ["tensorboard",
                                                                                                "mlflow"]})
    assert cfg.kafka.sasl_password.get_secret_value() == "sentinel-sasl-do-not-log"
    write_and_log(cfg, [1, 2]).close()
    directory = tmp_path / "run" / "trackers"
    assert b"sentinel-sasl-do-not-log" not in every_file_bytes(directory)
    params = mlflow_client(directory).get_run(mlflow_run_id(directory)).data.params
    assert params["kafka.sasl_password"] == "**********" and params["topics.run"] == "demo"
    assert "kafka.sasl_password" in tensorboard_texts(directory, "config")[0]


# -- an unreachable tracker ----------------------------------------------------------------------------------------

def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the socket is: nothing listens there


def test_unreachable_mlflow_never_blocks_and_warns_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = config(tmp_path, ["mlflow", "tensorboard"])
    caplog.set_level(logging.INFO, logger="stream_rl.telemetry.trackers")
    trackers = Trackers.open(cfg, None)
    slowest = 0.0
    for s in range(1, 41):
        t0 = time.perf_counter()
        trackers.log_step(row(s))
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.01)
    mlflow_worker = next(w for w in trackers.workers if w.tracker.name == "mlflow")
    assert mlflow_worker.failures >= 3  # retried with backoff while the steps went on
    trackers.close(timeout_s=0.5)
    assert slowest < 0.05, slowest
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "failed" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "tracker mlflow (telemetry.trackers) failed" in warnings[0]
    assert sorted(READERS["tensorboard"](tmp_path / "run" / "trackers")["reward/mean"]) == list(range(1, 41))


def test_full_queue_drops_and_warns_once(tmp_path, monkeypatch, caplog):
    """MLflow unreachable holds its worker on the first call: 3 more wait in the queue, the rest are dropped."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = config(tmp_path, ["mlflow"], tracker_queue=3, tracker_retry_s=5.0)
    caplog.set_level(logging.WARNING, logger="stream_rl.telemetry.trackers")
    trackers = Trackers.open(cfg, None)
    worker = trackers.workers[0]
    trackers.log_step(row(1))
    wait_until = time.monotonic() + 30
    while worker.failures == 0 and time.monotonic() < wait_until:  # the worker holds step 1, retrying
        time.sleep(0.01)
    for s in range(2, 11):
        trackers.log_step(row(s))
    assert worker.dropped == 6 and worker.queue.qsize() == 3
    trackers.close(timeout_s=0.5)
    full = [r for r in caplog.records if "queue full" in r.getMessage()]
    assert len(full) == 1 and "telemetry.tracker_queue" in full[0].getMessage()
    assert any("4 calls not logged at close" in r.getMessage() for r in caplog.records)


def test_mlflow_names():
    from stream_rl.telemetry.trackers.mlflow_backend import metric_name

    assert metric_name("eval/gsm8k/pass@8") == "eval/gsm8k/pass_at_8"
    assert metric_name("a b-c.d:e/f_g") == "a b-c.d:e/f_g"
    assert metric_name("x[0]{y}") == "x_0__y_"


# -- lazy imports ------------------------------------------------------------------------------------------------

BACKEND_MODULES = {f"stream_rl/telemetry/trackers/{name}_backend.py" for name in LIBRARIES}


def test_tracker_libraries_are_imported_lazily_by_their_backend_only():
    """No module of the product imports a tracker library at module level; inside functions only its backend."""
    problems = []
    for package in ("schemas", "stream_rl", "producers", "consumers", "evaluator"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(REPO_ROOT))
            tree = ast.parse(path.read_text(), rel)
            top_level = set(map(id, tree.body))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                for name in names:
                    if name.split(".")[0] in LIBRARIES or name.startswith("torch.utils.tensorboard"):
                        if rel not in BACKEND_MODULES or id(node) in top_level:
                            problems.append(f"{rel}:{node.lineno}: {name}")
    assert problems == []
