"""`stream-rl broker up|status|down` against a real tansu process (its own, separate from the session broker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.broker


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "stream_rl.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped by init in a container) counts as gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_up_status_down_lifecycle(tmp_path):
    state_dir = tmp_path / "state"
    up = _cli("broker", "up", "--state-dir", str(state_dir), cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    bootstrap = up.stdout.strip().splitlines()[-1]
    host, port = bootstrap.split(":")
    assert host == "127.0.0.1" and int(port) > 0
    state = json.loads((state_dir / "broker.json").read_text())
    assert state["bootstrap"] == bootstrap and state["storage"] == "durable"  # the default
    pid = state["pid"]
    store_pid = json.loads((state_dir / "store.json").read_text())["pid"]
    assert _alive(pid) and _alive(store_pid)
    assert oct((state_dir / "store-credentials.json").stat().st_mode & 0o777) == "0o600"

    again = _cli("broker", "up", "--state-dir", str(state_dir), cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.strip() == bootstrap  # reused, not a second broker

    ok = _cli("broker", "status", "--state-dir", str(state_dir), cwd=tmp_path)
    assert ok.returncode == 0 and "reachable (storage: durable)" in ok.stdout

    down = _cli("broker", "down", "--state-dir", str(state_dir), cwd=tmp_path)
    assert down.returncode == 0 and str(pid) in down.stdout
    assert not _alive(pid) and not _alive(store_pid)
    assert not (state_dir / "broker.json").exists() and not (state_dir / "store.json").exists()

    gone = _cli("broker", "status", "--state-dir", str(state_dir), cwd=tmp_path)
    assert gone.returncode != 0 and "no local broker recorded" in gone.stderr

    dead = _cli("broker", "status", "--bootstrap", bootstrap, cwd=tmp_path)
    assert dead.returncode != 0 and "did not answer" in dead.stderr


def test_down_leaves_unrelated_pid_alone(tmp_path):
    """A stale state file whose PID now belongs to another process must not get that process killed."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state_dir = tmp_path / "state"
        state_dir.mkdir()
        (state_dir / "broker.json").write_text(json.dumps({
            "pid": sleeper.pid, "port": 1, "bootstrap": "127.0.0.1:1", "binary": "tansu", "started_at": 0.0}))
        result = _cli("broker", "down", "--state-dir", str(state_dir), cwd=tmp_path)
        assert result.returncode == 0
        assert sleeper.poll() is None  # still alive
    finally:
        sleeper.kill()
        sleeper.wait()
