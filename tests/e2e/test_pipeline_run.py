"""The whole pipeline through the CLI, run once for this module: `stream-rl run` on the real local broker, every
role a separate process, the real demo model and verifier. Each test below checks one property of that run: it
exits 0 with every step, the reward rises, weights are broadcast every step, staleness stays bounded, every role
logged and none is left running, checkpoints exist, `stream-rl report` and `stream-rl trace show` work on it,
`stream-rl status --once --json` saw every role alive while it ran, and no file of the run directory holds a
prompt or response text of the run or the sentinel secret given through the environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.leaks import grep_leaks
from support.paths import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.timeout(1200)]  # the first test pays for the run
STEPS = 70
SECRET = "sentinel-Secret-7f3a9c"  # kafka.sasl_password from the environment; unused with PLAINTEXT


@dataclass
class Run:
    run_dir: Path
    run_name: str
    bootstrap: str
    returncode: int
    stdout: str
    stderr: str
    out_path: Path
    err_path: Path
    seen: dict | None  # the status snapshot that showed every role alive

    @property
    def rows(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(demo_build, broker, tmp_path_factory) -> Run:
    """`stream-rl run` of STEPS steps on the session broker, watched with `stream-rl status` while it runs."""
    demo_dir, _ = demo_build
    tmp_path = tmp_path_factory.mktemp("e2e")
    run_name, run_dir = f"t{uuid.uuid4().hex[:10]}", tmp_path / "run"
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "run", "-c", str(REPO_ROOT / "configs" / "demo.toml"),
           "--bootstrap", broker.bootstrap, "--run", run_name, "--max-steps", str(STEPS),
           "--set", f"run.demo_dir={demo_dir}", "--set", f"run_dir={run_dir}", "--set", "run.max_wall_s=900",
           "--set", "trainer.checkpoint_every=25", "--set", "tracing.exporter=jsonl"]  # telemetry: jsonl default
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STREAM_RL_KAFKA__SASL_PASSWORD": SECRET}
    out_path, err_path = tmp_path / "run.stdout", tmp_path / "run.stderr"  # files: a pipe could fill up
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=tmp_path, env=env)
        try:
            seen = _watch_status(proc, broker.bootstrap, run_name)
            proc.wait(timeout=1100)
        finally:
            if proc.poll() is None:  # a failed wait: stop the run (it stops its children on SIGTERM)
                proc.terminate()
                proc.wait(timeout=60)
    return Run(run_dir, run_name, broker.bootstrap, proc.returncode, out_path.read_text(), err_path.read_text(),
               out_path, err_path, seen)


@pytest.fixture(scope="module")
def finished(run: Run) -> Run:
    """The run, once it is known to have exited 0 (every other test needs that)."""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def test_run_exits_zero_with_every_step(finished):
    assert [r["step"] for r in finished.rows] == list(range(1, STEPS + 1))


def test_reward_rises(finished):
    rewards = [r["reward/mean"] for r in finished.rows]
    k = STEPS // 5
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    assert last - first >= 0.05, (first, last, rewards)
    assert f"{STEPS} steps: mean reward first 10%" in finished.stdout


def test_held_out_accuracy_rises(finished):
    """configs/demo.toml evaluates the demo's held-out split every 20 versions (and v0): greedy accuracy rises."""
    from stream_rl.evaluation.ledger import read_rows

    rows = sorted(read_rows(finished.run_dir / "evals.jsonl"), key=lambda r: r["version"])
    versions = [r["version"] for r in rows]
    assert versions[0] == 0 and len(versions) == len(set(versions)) >= 2, versions
    assert all(v % 20 == 0 for v in versions), versions
    metric = "heldout/greedy/accuracy"
    before, after = rows[0]["metrics"][metric], rows[-1]["metrics"][metric]
    assert after > before, [(r["version"], r["metrics"][metric]) for r in rows]
    assert "held-out accuracy before -> after:" in finished.stdout


def test_weights_are_broadcast_every_step(finished):
    rows = finished.rows
    assert rows[-1]["policy_version"] == STEPS
    assert len({r["policy_version"] for r in rows}) == STEPS


def test_staleness_stays_within_max_lag(finished):
    assert all(r["staleness/max_lag"] <= 4 for r in finished.rows)


def test_every_role_ran_as_its_own_process_and_none_is_left(finished):
    logs = sorted(p.name for p in (finished.run_dir / "logs").iterdir())
    assert logs == ["evaluate-0.log", "produce-0.log", "score-0.log", "train-0.log"]
    assert [pid for pid in _children_of_run(finished.run_dir) if _alive(pid)] == []


def test_checkpoints_are_written(finished):
    checkpoints = finished.run_dir / "checkpoints"
    assert checkpoints.is_dir() and any(checkpoints.iterdir())


def test_report_renders_every_panel_inline(finished):
    from typer.testing import CliRunner

    from stream_rl.cli.main import app

    report = CliRunner().invoke(app, ["report", str(finished.run_dir)])
    assert report.exit_code == 0, report.output
    pngs = sorted((finished.run_dir / "report").glob("*.png"))
    assert len(pngs) == 15, [p.name for p in pngs]  # 14 panels (every metric group is present) + overview
    assert {"epoch.png", "distinct_prompts.png", "success.png", "evaluation.png"} <= {p.name for p in pngs}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1024 for p in pngs)
    page = (finished.run_dir / "report" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(pngs) and "<script" not in page
    assert f"steps: {STEPS} (step 1 .. {STEPS})" in report.stdout


def test_trace_show_follows_a_trained_rollout_into_its_step(finished):
    from typer.testing import CliRunner

    from stream_rl.cli.main import app

    last = json.loads((finished.run_dir / "trained.jsonl").read_text().splitlines()[-1])
    shown = CliRunner().invoke(app, ["trace", "show", str(finished.run_dir), "--rollout", last["rollout_ids"][0]])
    assert shown.exit_code == 0, shown.output
    names = [line.lstrip("│├└─ ").split(" [")[0] for line in shown.stdout.splitlines()]
    sends = [n for n in names if n.startswith("send ")]
    run_name = finished.run_name
    assert sends[:2] == [f"send stream-rl.{run_name}.rollouts", f"send stream-rl.{run_name}.scored"], names
    assert names.index("process score") < names.index(sends[1]) < names.index("linked from:")
    assert "process train-step" in names[names.index("linked from:"):], names
    assert f"step={last['step']}" in shown.stdout


def test_no_file_of_the_run_holds_sample_text_or_the_secret(finished):
    needles = [SECRET, *_sample_texts(finished.bootstrap, finished.run_name)]
    leaks = grep_leaks(finished.run_dir, finished.out_path, finished.err_path, needles=needles)
    assert leaks == "", leaks[:2000]


def test_status_saw_every_role_alive_with_the_weights_version(finished):
    seen = finished.seen
    assert seen is not None, "status never showed producer, scorer, trainer and evaluator alive with a weights version"
    roles = {r["role"] for r in seen["roles"] if r["status"] == "alive"}
    assert roles == {"producer", "scorer", "trainer", "evaluator"}, seen["roles"]  # the demo's [eval] evaluator
    trainer = next(r for r in seen["roles"] if r["role"] == "trainer")
    assert 1 <= seen["weights"]["version"] <= STEPS and trainer["policy_version"] <= seen["weights"]["version"]


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


def _watch_status(proc: subprocess.Popen, bootstrap: str, run_name: str) -> dict | None:
    """Poll `stream-rl status --once --json` until it shows producer, scorer and trainer alive and a weights
    version (the snapshot), or the run ends (None)."""
    from typer.testing import CliRunner

    from stream_rl.cli.main import app

    while proc.poll() is None:
        out = CliRunner().invoke(app, ["status", "--once", "--json", "--bootstrap", bootstrap, "--run", run_name,
                                       "--interval", "0.5"])
        if out.exit_code == 0:
            snap = json.loads(out.stdout)
            alive = {r["role"] for r in snap["roles"] if r["status"] == "alive"}
            if alive >= {"producer", "scorer", "trainer", "evaluator"} and \
                    (snap["weights"] or {}).get("version", 0) >= 1:
                return snap
        time.sleep(3.0)
    return None


def _sample_texts(bootstrap: str, run_name: str) -> set[str]:
    """Every prompt and response text on the run's rollouts topic, as searchable strings: each line of >= 5
    characters that is not only digits and dots (those would match timestamps and metric values)."""
    from support.topics import read_values

    from stream_rl.cli.config import load_config
    from stream_rl.transport.client import Transport

    cfg = load_config(None, env={}, overrides={"kafka.bootstrap_servers": bootstrap, "topics.run": run_name})
    transport = Transport(cfg, "test")
    texts = set()
    for rollout in read_values(transport, transport.names.rollouts, "rollout"):
        texts.update(rollout.prompt_text.splitlines() + rollout.response_text.splitlines())
    found = {t for t in texts if len(t) >= 5 and not re.fullmatch(r"[0-9.]*", t)}
    assert len(found) >= 50, sorted(found)[:20]  # the demo's prompts ("12+34=") are all searchable
    return found


