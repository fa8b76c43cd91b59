"""The whole pipeline through the CLI: `stream-rl run` on the real local broker, every role a separate process,
the real demo model and verifier; the reward must rise, and the run must end with every child gone. While it runs,
`stream-rl status --once --json` must report every role and the weights version; afterwards `stream-rl trace show`
must show a trained rollout's trace, and no file of the run directory may hold a prompt or response text of the
run or the sentinel secret given through the environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.broker]
ROOT = Path(__file__).resolve().parents[1]
STEPS = 70
SECRET = "sentinel-Secret-7f3a9c"  # kafka.sasl_password from the environment; unused with PLAINTEXT


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
    result = subprocess.CompletedProcess(cmd, proc.returncode, out_path.read_text(), err_path.read_text())
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
    assert len(pngs) == 14, [p.name for p in pngs]  # 13 panels (every metric group is present) + overview
    assert {"epoch.png", "distinct_prompts.png", "success.png"} <= {p.name for p in pngs}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1024 for p in pngs)
    page = (run_dir / "report" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(pngs) and "<script" not in page
    assert f"steps: {STEPS} (step 1 .. {STEPS})" in report.stdout
    # `stream-rl trace show --rollout` on a rollout of the last step: its lineage and the step that trained it
    last = json.loads((run_dir / "trained.jsonl").read_text().splitlines()[-1])
    shown = CliRunner().invoke(app, ["trace", "show", str(run_dir), "--rollout", last["rollout_ids"][0]])
    assert shown.exit_code == 0, shown.output
    names = [line.lstrip("│├└─ ").split(" [")[0] for line in shown.stdout.splitlines()]
    sends = [n for n in names if n.startswith("send ")]
    assert sends[:2] == [f"send stream-rl.{run_name}.rollouts", f"send stream-rl.{run_name}.scored"], names
    assert names.index("process score") < names.index(sends[1]) < names.index("linked from:")
    assert "process train-step" in names[names.index("linked from:"):], names
    assert f"step={last['step']}" in shown.stdout
    # privacy: no prompt or response text of the run, and not the secret, in any file of the run directory
    leaks = _grep(run_dir, out_path, err_path, needles=[SECRET, *_sample_texts(broker.bootstrap, run_name)])
    assert leaks == "", leaks[:2000]
    # `stream-rl status --once --json` while the pipeline ran: every role alive, the current weights version
    assert seen is not None, "status never showed producer, scorer and trainer alive with a weights version"
    roles = {r["role"] for r in seen["roles"] if r["status"] == "alive"}
    assert roles == {"producer", "scorer", "trainer"}, seen["roles"]
    trainer = next(r for r in seen["roles"] if r["role"] == "trainer")
    assert 1 <= seen["weights"]["version"] <= STEPS and trainer["policy_version"] <= seen["weights"]["version"]


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
            if alive >= {"producer", "scorer", "trainer"} and (snap["weights"] or {}).get("version", 0) >= 1:
                return snap
        time.sleep(3.0)
    return None


def _sample_texts(bootstrap: str, run_name: str) -> set[str]:
    """Every prompt and response text on the run's rollouts topic, as searchable strings: each line of >= 5
    characters that is not only digits and dots (those would match timestamps and metric values)."""
    from stream_rl.config import load_config
    from stream_rl.transport.client import Transport
    from topic_read import read_values

    cfg = load_config(None, env={}, overrides={"kafka.bootstrap_servers": bootstrap, "topics.run": run_name})
    transport = Transport(cfg, "test")
    texts = set()
    for rollout in read_values(transport, transport.names.rollouts, "rollout"):
        texts.update(rollout.prompt_text.splitlines() + rollout.response_text.splitlines())
    found = {t for t in texts if len(t) >= 5 and not re.fullmatch(r"[0-9.]*", t)}
    assert len(found) >= 50, sorted(found)[:20]  # the demo's prompts ("12+34=") are all searchable
    return found


def _grep(run_dir: Path, *files: Path, needles: list[str]) -> str:
    """`grep -rFao` of every needle over every file under ``run_dir`` and ``files``: the matches, or "".

    A ``.safetensors`` file is searched in its JSON header (names, dtypes, metadata: where text could be
    written) but not in its tensor bytes: AdamW's second moments are floats whose high bytes are ASCII digits
    (0x30-0x39 is the high byte of floats from about 5e-10 to 5e-4), so the demo's short prompts ("72+78=") turn up there by chance."""
    patterns = run_dir.parent / "needles.txt"
    patterns.write_text("".join(n + "\n" for n in needles))
    out = subprocess.run(["grep", "-rFao", "--exclude=*.safetensors", "-f", str(patterns), str(run_dir),
                          *map(str, files)], capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr  # 1: nothing matched
    headers = {p: _safetensors_header(p) for p in run_dir.rglob("*.safetensors")}
    assert headers, "the run wrote no safetensors file: nothing checked there"
    return out.stdout + "".join(f"{p} (header):{n}\n" for p, h in headers.items() for n in needles if n in h)


def _safetensors_header(path: Path) -> str:
    """The JSON header of a safetensors file: an 8-byte little-endian length, then that many bytes."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return f.read(size).decode()
