"""Issue 13: the failures a new user meets end in ONE line they can act on (what failed, the address or value, what
to do) and the documented exit code, quickly; a traceback only with ``--debug`` / ``STREAM_RL_DEBUG=1``.

Every test runs the command as a user types it (``python -m stream_rl.cli.main ...``) in an empty directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.paths import REPO_ROOT

ROOT = REPO_ROOT
NO_BROKER = "127.0.0.1:1"  # nothing listens on port 1
QUICK = ["--set", "kafka.connect_timeout_s=1"]


def cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_RL_")}
    return subprocess.run([sys.executable, "-m", "stream_rl.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env={**base, "PYTHONUNBUFFERED": "1", **(env or {})})


def one_line(result: subprocess.CompletedProcess) -> str:
    """The single line on stderr (asserting there is exactly one and no traceback)."""
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    return lines[0]


def last_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_id": "p0", "text": "1+1=", "answer": "2"}) + "\n")
    return path


@pytest.mark.parametrize("command", [
    ["train", "--set", "trainer.model_dir=policy"],
    ["score", "--set", "run.demo_dir=null"],
    ["produce", "--set", "producer.model_dir=policy"],
    ["replay", "rollouts", "--run", "r1"],
    ["topics", "list"],
    ["topics", "create"],
    ["prompts", "load", "p.jsonl"],
])
def test_no_broker_at_the_address_is_one_line_naming_it(tmp_path, prompts, command):
    started = time.monotonic()
    result = cli(*command, "-b", NO_BROKER, *QUICK, cwd=tmp_path)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    line = one_line(result)
    assert NO_BROKER in line and "stream-rl broker up" in line and "--bootstrap" in line
    assert took < 25, f"took {took:.0f}s"  # kafka-python alone retries for 30 s


def test_no_broker_recorded_is_one_line(tmp_path):
    result = cli("topics", "create", "--set", f"broker.state_dir={tmp_path / 'none'}", cwd=tmp_path)
    assert result.returncode == 1
    line = one_line(result)
    assert str(tmp_path / "none") in line and "stream-rl broker up" in line


@pytest.mark.parametrize("debug", [["--debug"], "env"])
def test_debug_shows_the_traceback(tmp_path, debug):
    args = ["topics", "create", "-b", NO_BROKER, *QUICK]
    result = (cli(*debug, *args, cwd=tmp_path) if debug != "env"
              else cli(*args, cwd=tmp_path, env={"STREAM_RL_DEBUG": "1"}))
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "BrokerUnreachable" in result.stderr and "require_broker" in result.stderr


def test_a_genuine_bug_keeps_its_traceback(tmp_path):
    """An exception that is not an expected failure is not hidden behind one line."""
    code = ("import typer, stream_rl.cli.main as m\n"
            "@m.app.command('boom')\n"
            "def boom() -> None:\n"
            "    raise ZeroDivisionError('a bug')\n"
            "m.main()\n")
    result = subprocess.run([sys.executable, "-c", code, "boom"], capture_output=True, text=True, cwd=tmp_path,
                            timeout=60)
    assert result.returncode == 1 and "Traceback" in result.stderr and "ZeroDivisionError: a bug" in result.stderr


@pytest.mark.broker
def test_a_missing_model_directory_is_one_line(broker, tmp_path, run_name):
    missing = tmp_path / "no-such-model"
    result = cli("train", "-b", broker.bootstrap, "--run", run_name, "--set", f"trainer.model_dir={missing}",
                 "--set", f"run_dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    line = last_line(result)
    assert line.startswith("error: ") and str(missing) in line and "stream-rl demo init" in line


@pytest.mark.broker
def test_a_telemetry_port_in_use_is_one_line_naming_it(broker, tmp_path, run_name):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = cli("score", "-b", broker.bootstrap, "--run", run_name, "--set", "run.demo_dir=null",
                     "--set", f"telemetry.http_port={port}", "--set", f"run_dir={tmp_path / 'run'}",
                     cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stderr
    line = last_line(result)
    assert line.startswith("error: address already in use") and f"127.0.0.1:{port}" in line
    assert "telemetry.http_port" in line


def test_a_role_started_by_hand_without_the_demo_says_to_build_it(tmp_path):
    """README: `stream-rl train -c configs/demo.toml`, one role per process, on a fresh clone."""
    result = cli("train", "-c", str(ROOT / "configs" / "demo.toml"), cwd=tmp_path)
    assert result.returncode == 2
    line = one_line(result)
    assert "trainer.model_dir" in line and "stream-rl demo init runs/demo-model" in line and "make run" in line


@pytest.mark.parametrize("role,field,expected,extra", [
    ("train", "trainer.model_dir", str(Path("runs/demo-model") / "policy"), []),
    ("produce", "producer.model_dir", str(Path("runs/demo-model") / "policy"), []),
    ("score", "scorer.reward_fn", "stream_rl.demo.task:addition_reward", []),
    ("score", "scorer.reference_model_dir", None, []),  # kl.coef 0: nothing consumes reference logprobs
    ("score", "scorer.reference_model_dir", str(Path("runs/demo-model") / "reference"),
     ["--set", "trainer.kl.coef=0.05"])])
def test_a_role_started_by_hand_uses_the_built_demo_like_run(tmp_path, role, field, expected, extra):
    (tmp_path / "runs" / "demo-model" / "policy").mkdir(parents=True)
    result = cli(role, "-c", str(ROOT / "configs" / "demo.toml"), "--dry-run", *extra, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    section, name = field.split(".")
    assert json.loads(result.stdout)[section][name] == expected


def test_demo_init_on_an_existing_directory_names_the_flag(tmp_path):
    (tmp_path / "demo").mkdir()
    for extra in ([], ["--dry-run"]):
        result = cli("demo", "init", "demo", *extra, cwd=tmp_path)
        assert result.returncode == 2
        line = one_line(result)
        assert "--overwrite" in line and "overwrite=True" not in line


def test_demo_init_dry_run_builds_nothing(tmp_path):
    result = cli("demo", "init", "demo", "--dry-run", "--seed", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"directory": "demo", "seed": 3, "reward_model": True, "overwrite": False,
                                         "exists": False}
    assert not (tmp_path / "demo").exists()


def test_a_broker_port_in_use_is_one_line_naming_it(tmp_path, prompts):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = cli("run", "--max-steps", "1", "--set", "run.demo_dir=null", "--set", f"run.prompts_file={prompts}",
                     "--set", f"broker.port={port}", "--set", f"broker.state_dir={tmp_path / 'broker'}",
                     "--set", "broker.storage=memory", cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stderr
    line = one_line(result)
    assert f"127.0.0.1:{port} (broker.port={port})" in line and "already in use" in line and "panicked" not in line
