"""`stream-rl run -c configs/demo-servers.toml`: the demo generating on two `vllm serve` processes that `run` starts,
one of them killed with SIGKILL mid-run.

Checked: the run finishes every step and exits 0; the producer re-issued the dead server's requests on the other
and went on; no rollout id is trained twice (``trained.jsonl``) and every step trained a full batch of groups; the
servers are gone when the run has ended.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest
from support.paths import REPO_ROOT
from support.vllm_servers import vllm_problem

pytestmark = [pytest.mark.slow, pytest.mark.broker,
              pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))]

STEPS, GROUPS, GROUP_SIZE = 6, 8, 8


def _wait_for(predicate, what: str, proc: subprocess.Popen, timeout_s: float, out) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached (run exit {proc.poll()}):\n{out.read_text()[-3000:]}")
        time.sleep(0.5)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_demo_on_two_servers_survives_a_server_killed_mid_run(demo_build, broker, tmp_path):
    demo_dir, _ = demo_build
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "run", "-c", str(REPO_ROOT / "configs" / "demo-servers.toml"),
           "--bootstrap", broker.bootstrap, "--run", f"s{uuid.uuid4().hex[:10]}", "--max-steps", str(STEPS),
           "--set", f"run.demo_dir={demo_dir}", "--set", f"run_dir={run_dir}", "--set", "run.max_wall_s=600",
           "--set", f"trainer.groups_per_step={GROUPS}", "--set", f"producer.max_groups_per_version={GROUPS}",
           "--set", f"producer.prompts_per_batch={GROUPS}", "--set", f"scorer.batch_size={GROUPS * GROUP_SIZE}",
           "--set", "eval.max_prompts=16", "--set", "eval.batch_size=16"]
    out = tmp_path / "run.out"
    with open(out, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_for(lambda: len(_rows(run_dir / "metrics.jsonl")) >= 2, "two trainer steps", proc, 400, out)
        servers = json.loads((run_dir / "servers.json").read_text())
        assert len(servers) == 2 and (run_dir / "servers-0.urls").read_text().split() == [s["url"] for s in servers]
        os.kill(servers[1]["pid"], signal.SIGKILL)
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
    text = out.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    trained = _rows(run_dir / "trained.jsonl")
    ids = [rid for line in trained for rid in line["rollout_ids"]]
    assert len(ids) == STEPS * GROUPS * GROUP_SIZE and not [i for i, n in Counter(ids).items() if n > 1]
    producer_log = (run_dir / "logs" / "produce-0.log").read_text()
    assert f"server {servers[1]['url']} marked down" in producer_log  # by a request or a version it failed
    deadline = time.monotonic() + 30  # `run` stopped both process groups (a server and its engine processes);
    while any(_group_alive(s["pid"]) for s in servers) and time.monotonic() < deadline:  # SIGKILLed members
        time.sleep(0.5)                                                                  # are reaped by init
    assert not [s for s in servers if _group_alive(s["pid"])], "a server left processes behind"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
