"""The whole pipeline through the CLI: `stream-rl run` on the real local broker, every role a separate process,
the real demo model and verifier; the reward must rise, and the run must end with every child gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.broker]
ROOT = Path(__file__).resolve().parents[1]
STEPS = 70


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _children_of_run(run_dir: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(run_dir) in cmd and "stream_rl.cli.main" in cmd:
                pids.append(int(proc.name))
    return pids


@pytest.mark.timeout(1200)
def test_run_trains_the_demo_and_reward_rises(demo_build, broker, tmp_path, run_name):
    demo_dir, _ = demo_build
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "run", "-c", str(ROOT / "configs" / "demo.toml"),
           "--bootstrap", broker.bootstrap, "--run", run_name, "--max-steps", str(STEPS),
           "--set", f"run.demo_dir={demo_dir}", "--set", f"run_dir={run_dir}", "--set", "run.max_wall_s=900",
           "--set", "trainer.checkpoint_every=25"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1100, cwd=tmp_path,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    rewards = [r["reward/mean"] for r in rows]
    k = STEPS // 5
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    assert last - first >= 0.05, (first, last, rewards)
    assert f"{STEPS} steps: mean reward first 10%" in result.stdout
    assert rows[-1]["policy_version"] == STEPS  # broadcast every step
    versions = {r["policy_version"] for r in rows}
    assert len(versions) == STEPS
    assert all(r["staleness/max_lag"] <= 4 for r in rows)
    # every role ran as its own process and wrote its log; none is left running
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["produce-0.log", "score-0.log", "train-0.log"]
    assert [pid for pid in _children_of_run(run_dir) if _alive(pid)] == []
    assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    # `stream-rl report` on this real run directory: one non-empty PNG per panel plus the overview, all inlined
    from typer.testing import CliRunner

    from stream_rl.cli.main import app

    report = CliRunner().invoke(app, ["report", str(run_dir)])
    assert report.exit_code == 0, report.output
    pngs = sorted((run_dir / "report").glob("*.png"))
    assert len(pngs) == 11, [p.name for p in pngs]  # 10 panels (every metric group is present) + overview
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1024 for p in pngs)
    page = (run_dir / "report" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(pngs) and "<script" not in page
    assert f"steps: {STEPS} (step 1 .. {STEPS})" in report.stdout
