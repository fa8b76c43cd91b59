"""Issue 35.1: a run name used twice is continued only on purpose (``--resume``) or refused in one line that says what
is there and the ways on; ``stream-rl topics delete`` removes a run. (A trainer started by hand on another trainer's
run stops with that diagnosis instead of dropping its data as "stale": tests/unit/test_trainer_loop_runs.py.)

Before the fix, ``stream-rl run --run NAME`` a second time loaded its prompts next to the first run's records and
churned until ``run.max_wall_s``; a fresh trainer re-queued every rollout of the first run as stale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from schemas import Prompt
from stream_rl.cli.runs import records_on_broker
from stream_rl.transport.client import Transport

torch.set_num_threads(1)


def _cli(*args: str, cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stream_rl.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _earlier_run(make_config, run_dir: Path) -> tuple[Transport, int]:
    """What a first `stream-rl run` left: its topics with 3 prompts and a committed trainer-group offset, and its run
    directory (config.yaml naming the run)."""
    cfg = make_config(**{"run_dir": str(run_dir)})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    for i in range(3):
        sink.send(transport.names.prompts, Prompt(prompt_id=f"p{i}", epoch=0, text="1+1=", answer="2", group_size=2,
                                                  metadata={}, attempt=0, created_at=1.0), key=f"p{i}")
    sink.flush()
    sink.close()
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"topics:\n  run: {cfg.topics.run}\n")
    return transport, 3


def _run_args(broker, run_name: str, prompts: Path, *extra: str) -> list[str]:
    return ["run", "--bootstrap", broker.bootstrap, "--run", run_name, "--max-steps", "1",
            "--set", "run.demo_dir=null", "--set", f"run.prompts_file={prompts}",
            "--set", "scorer.reward_fn=stream_rl.demo.task:addition_reward", *extra]


@pytest.mark.broker
def test_a_run_name_with_records_is_refused_in_one_line_and_topics_delete_frees_it(make_config, broker, run_name,
                                                                                    tmp_path):
    transport, _ = _earlier_run(make_config, tmp_path / "runs" / run_name)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_id": "q0", "text": "1+1=", "answer": "2"}) + "\n")

    again = _cli(*_run_args(broker, run_name, prompts, "--set", f"run_dir={tmp_path / 'B'}"), cwd=tmp_path)
    assert again.returncode == 2, again.stdout + again.stderr
    line = again.stderr.strip().splitlines()[-1]
    assert line.startswith(f"run {run_name} already has 3 records on the broker at {broker.bootstrap} (prompts 3)"), line
    assert f"written by run dir {Path('runs') / run_name}" in line, line
    for way in (f"`stream-rl run --resume --run {run_name}`", "--run NAME", f"`stream-rl topics delete --run {run_name}`"):
        assert way in line, line
    assert "prompts loaded" not in again.stdout and not (tmp_path / "B").exists()  # nothing started, nothing loaded
    assert sum(records_on_broker(transport.cfg).values()) == 3

    nothing = _cli("run", "--bootstrap", broker.bootstrap, "--run", f"{run_name}x", "--resume", "--max-steps", "1",
                   "--set", "run.demo_dir=null", "--set", f"run.prompts_file={prompts}", cwd=tmp_path)
    assert nothing.returncode == 2 and f"run {run_name}x has no records on the broker" in nothing.stderr

    gone = _cli("topics", "delete", "--bootstrap", broker.bootstrap, "--run", run_name, cwd=tmp_path)
    assert gone.returncode == 0 and f"run {run_name}: deleted 11 topics" in gone.stdout, gone.stdout + gone.stderr
    assert records_on_broker(transport.cfg) == {}
    with transport.admin() as admin:
        assert not any(t.startswith(f"stream-rl.{run_name}.") for t in admin.list_topics())


@pytest.mark.broker
def test_resume_passes_the_check_and_continues_in_the_run_dir_that_wrote_it(make_config, run_name, tmp_path,
                                                                            monkeypatch):
    """`stream-rl run --resume` (its check, in process): the run's records are expected, and the run directory is
    the one that wrote them (found under runs/ here; the local broker's record of it in `stream-rl run`)."""
    import typer

    from stream_rl.cli.run_cmd import _check_reuse

    monkeypatch.chdir(tmp_path)
    _earlier_run(make_config, tmp_path / "runs" / run_name)
    cfg = make_config()
    cfg.model_fields_set.discard("run_dir")  # as `stream-rl run --resume --run NAME` without run_dir
    _check_reuse(cfg, True, local_broker=False)
    assert Path(cfg.run_dir) == Path("runs") / run_name
    with pytest.raises(typer.Exit) as refused:
        _check_reuse(make_config(), False, local_broker=False)
    assert refused.value.exit_code == 2
