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
    assert proc.returncode in (1, 143), out + err  # SIGTERM (128 + 15), or a role died first: either way it ended
    for pid in (broker_pid, store_pid):
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    assert not (state_dir / "broker.json").exists() and not (state_dir / "store.json").exists()
