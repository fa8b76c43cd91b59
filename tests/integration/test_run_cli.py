"""`stream-rl run` supervision: a role that dies stops the run, which exits non-zero naming the role."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.broker


def test_run_names_the_role_that_died_and_stops_the_others(broker, tmp_path, run_name):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_id": f"p{i}", "text": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                               for i in range(4)))
    missing = tmp_path / "no-such-model"
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "run", "--bootstrap", broker.bootstrap, "--run", run_name,
           "--max-steps", "3", "--set", "run.demo_dir=null", "--set", f"run.prompts_file={prompts}", "--set", "run.epochs=10",
           "--set", f"run_dir={tmp_path / 'run'}", "--set", f"trainer.model_dir={missing}",
           "--set", f"producer.model_dir={missing}", "--set", "scorer.reward_fn=stream_rl.demo.task:addition_reward"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "run failed: role " in result.stderr
    died = result.stderr.split("run failed: role ")[1].split()[0]
    assert died in {"train-0", "produce-0"}
    failed = next(line for line in result.stderr.splitlines() if line.startswith("run failed: role "))
    assert "no-such-model" in failed.split("(log: ")[0]  # the role's own last error line is quoted
    log = (tmp_path / "run" / "logs" / f"{died}.log").read_text()
    assert str(missing) in log  # the role's own error names the missing directory
    assert ": 40 prompts loaded" in result.stdout  # 4 prompts x run.epochs (10)


def test_run_dry_run_fills_demo_paths(tmp_path):
    from typer.testing import CliRunner

    from stream_rl.cli.main import app

    out = CliRunner().invoke(app, ["run", "--dry-run", "--set", f"run.demo_dir={tmp_path / 'demo'}",
                                   "--set", "producer.temperature=0.7"])
    assert out.exit_code == 0, out.output
    cfg = json.loads(out.output)
    assert cfg["producer"]["model_dir"] == str(tmp_path / "demo" / "policy")
    assert cfg["scorer"]["reference_model_dir"] is None  # kl.coef 0, no kl.report: no reference forward pass
    assert cfg["run"]["prompts_file"] == str(tmp_path / "demo" / "prompts.jsonl")
    assert cfg["producer"]["temperature"] == 0.7
    assert cfg["topics"]["run"].startswith("demo-")  # every run gets its own topics


@pytest.mark.parametrize("setting", ["trainer.kl.coef=0.05", "trainer.kl.report=true"])
def test_run_gives_the_scorer_the_reference_when_consumed(tmp_path, setting):
    from typer.testing import CliRunner

    from stream_rl.cli.main import app

    out = CliRunner().invoke(app, ["run", "--dry-run", "--set", f"run.demo_dir={tmp_path / 'demo'}",
                                   "--set", setting])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["scorer"]["reference_model_dir"] == str(tmp_path / "demo" / "reference")


def test_run_without_a_step_budget_is_refused():
    from typer.testing import CliRunner

    from stream_rl.cli.main import app

    out = CliRunner().invoke(app, ["run", "--set", "run.demo_dir=null", "--set", "run.prompts_file=x.jsonl"])
    assert out.exit_code == 2 and "trainer.max_steps" in out.output


def test_sigterm_stops_the_roles_and_the_broker_it_started(tmp_path):
    """SIGTERM to `stream-rl run` cleans up as Ctrl-C does: no role, no broker and no store is left running."""
    import signal
    import time

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_id": "p0", "text": "1+1=", "answer": "2"}) + "\n")
    missing = tmp_path / "no-such-model"  # the roles fail to load it: the run waits on them until it is told
    state_dir = tmp_path / "broker-state"
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "run", "--max-steps", "3", "--set", "run.demo_dir=null",
           "--set", f"run.prompts_file={prompts}", "--set", f"broker.state_dir={state_dir}",
           "--set", f"run_dir={tmp_path / 'run'}", "--set", f"trainer.model_dir={missing}",
           "--set", f"producer.model_dir={missing}", "--set", "scorer.reward_fn=stream_rl.demo.task:addition_reward"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (state_dir / "broker.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        broker_pid = json.loads((state_dir / "broker.json").read_text())["pid"]
        store_pid = json.loads((state_dir / "store.json").read_text())["pid"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (1, 130), out + err  # interrupted, or a role died first: either way it ended
    for pid in (broker_pid, store_pid):
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    assert not (state_dir / "broker.json").exists() and not (state_dir / "store.json").exists()


@pytest.mark.parametrize("log,quoted", [
    # a traceback after earlier log lines: its exception line
    ("2026-12-01 10:00:00,000 INFO stream_rl.trainer: starting\n"
     "2026-12-01 10:00:01,000 ERROR kafka.net.manager: an earlier error\n"
     "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
     "ValueError: Unsupported CPU attention configuration: head_dim=16\n",
     "ValueError: Unsupported CPU attention configuration: head_dim=16"),
    # the alert that stopped it, followed by INFO lines of the shutdown
    ("2026-12-01 10:00:00,000 CRITICAL stream_rl.alerts: alert reward_drop (stop): reward fell by 0.4\n"
     "2026-12-01 10:00:00,500 INFO stream_rl.trainer: checkpoint written\n",
     "2026-12-01 10:00:00,000 CRITICAL stream_rl.alerts: alert reward_drop (stop): reward fell by 0.4"),
    # vLLM's own log format
    ("(EngineCore_0 pid=7) ERROR 12-01 10:00:00 [core.py:1] Unsupported CPU attention configuration\nbye\n",
     "(EngineCore_0 pid=7) ERROR 12-01 10:00:00 [core.py:1] Unsupported CPU attention configuration"),
    # a stream-rl command's one-line failure
    ("2026-12-01 10:00:00,000 INFO x: y\nerror: no Kafka broker at 127.0.0.1:1 (tried for 5 s): start one\n",
     "error: no Kafka broker at 127.0.0.1:1 (tried for 5 s): start one"),
    ("just a line\nthe last line\n", "the last line"),  # nothing that looks like an error: the last line
])
def test_a_dead_role_is_reported_with_its_last_error_line(tmp_path, log, quoted):
    from stream_rl.launch.orchestrator import RoleDied

    path = tmp_path / "train-0.log"
    path.write_text(log)
    assert str(RoleDied("train-0", 1, path)) == f"role train-0 exited with code 1: {quoted} (log: {path})"


def test_the_quoted_error_line_is_trimmed(tmp_path):
    from stream_rl.launch.orchestrator import last_error_line

    path = tmp_path / "score-0.log"
    path.write_text("RuntimeError: " + "x" * 500 + "\n")
    line = last_error_line(path)
    assert len(line) == 200 and line.startswith("RuntimeError: xxx") and line.endswith("...")
    assert last_error_line(tmp_path / "missing.log") == "(no log)"
