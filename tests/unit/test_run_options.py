"""`stream-rl run` before it starts anything: the demo paths its dry run fills in, the reference handed to the scorer,
the refused run without a step budget, and how a dead role's last error line is reported."""

from __future__ import annotations

import json

import pytest


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
