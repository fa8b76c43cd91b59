"""`stream-rl gc`: the plan against hand-built run directories, its application, and the command line."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stream_rl.cli.main import app
from stream_rl.operator_tools.gc import DAY_S, GcPaths, GcPolicy, apply_gc, plan_gc

NOW = float(int(time.time()))  # the CLI test plans with the real clock: ages are relative to now


def _touch(path: Path, age_days: float, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, (NOW - age_days * DAY_S, NOW - age_days * DAY_S))
    return path


def _checkpoint(root: Path, step: int, age_days: float, complete: bool = True) -> Path:
    path = root / f"step-{step:08d}"
    _touch(path / "model.safetensors", age_days, b"m" * 100)
    if complete:
        _touch(path / "trainer.json", age_days, b"{}")
    os.utime(path, (NOW - age_days * DAY_S, NOW - age_days * DAY_S))
    return path


@pytest.fixture
def run(tmp_path: Path) -> GcPaths:
    """A run directory: 5 complete checkpoints (ages 10..2 days) + 1 incomplete, 5 weight versions, leftovers,
    logs, spans, telemetry and files gc must never touch."""
    run_dir = tmp_path / "run"
    ck = run_dir / "checkpoints"
    for step, age in [(100, 10), (200, 8), (300, 6), (400, 4), (500, 2)]:
        _checkpoint(ck, step, age)
    _checkpoint(ck, 600, 0.01, complete=False)  # a save in progress under its final name never happens; keep it
    _touch(ck / ".del-step-00000050-abc123" / "model.safetensors", 0.0)
    _touch(ck / ".tmp-step-00000700-1" / "model.safetensors", 0.0)  # a live save: too fresh to remove
    _touch(ck / ".tmp-step-00000090-2" / "model.safetensors", 3.0)
    os.utime(ck / ".tmp-step-00000090-2", (NOW - 3 * DAY_S, NOW - 3 * DAY_S))
    os.utime(ck / ".tmp-step-00000700-1", (NOW, NOW))
    os.utime(ck / ".del-step-00000050-abc123", (NOW, NOW))
    weights = run_dir / "weights"
    for version, age in [(1, 9), (2, 7), (3, 5), (4, 3), (5, 1)]:
        _touch(weights / f"v{version:08d}.safetensors", age, b"w" * 1000)
    _touch(weights / ".v00000003.safetensors.ab12.tmp", 5.0)   # abandoned: version 3 <= newest 5
    _touch(weights / ".v00000006.safetensors.cd34.tmp", 5.0)   # version 6 > newest: may be in progress
    _touch(weights / ".v00000002.safetensors.ef56.tmp", 0.0)   # too fresh
    _touch(weights / "notes.txt", 30.0)
    _touch(run_dir / "logs" / "train-0.log", 0.5)
    _touch(run_dir / "logs" / "train-0.log.1", 5.0)
    _touch(run_dir / "logs" / "produce-0.log.2.gz", 9.0)
    _touch(run_dir / "spans.jsonl", 1.0)
    _touch(run_dir / "spans.jsonl.1", 4.0)
    _touch(run_dir / "telemetry" / "trainer-0.jsonl", 4.0)
    for keep in ("config.yaml", "metrics.jsonl", "trained.jsonl"):
        _touch(run_dir / keep, 30.0)
    return GcPaths(checkpoint_dir=ck, weights_dir=weights, logs_dir=run_dir / "logs",
                   spans_file=run_dir / "spans.jsonl", telemetry_dir=run_dir / "telemetry")


def _names(actions) -> set[str]:
    return {a.path.name for a in actions}


def _tree(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.lstat().st_mtime_ns) for p in root.rglob("*"))


def test_plan_by_count_keeps_newest_and_touches_nothing(run):
    root = run.checkpoint_dir.parent
    before = _tree(root)
    actions = plan_gc(run, GcPolicy(keep_checkpoints=2, keep_weights=2), NOW)
    assert _tree(root) == before  # planning reads only
    assert _names(actions) == {
        "step-00000100", "step-00000200", "step-00000300",           # beyond the newest 2 complete
        ".del-step-00000050-abc123", ".tmp-step-00000090-2",         # leftovers (old enough tmp)
        "v00000001.safetensors", "v00000002.safetensors", "v00000003.safetensors",
        ".v00000003.safetensors.ab12.tmp"}                           # abandoned write
    by_name = {a.path.name: a for a in actions}
    assert by_name["step-00000100"].kind == "checkpoint"
    assert by_name["step-00000100"].size_bytes == 100 + 2
    assert by_name["v00000001.safetensors"].size_bytes == 1000


def test_plan_with_age_limit_adds_run_files_and_spares_young_items(run):
    actions = plan_gc(run, GcPolicy(keep_checkpoints=2, keep_weights=2, older_than_s=5 * DAY_S), NOW)
    assert _names(actions) == {
        "step-00000100", "step-00000200", "step-00000300",           # 10, 8, 6 days old (>= 5)
        ".del-step-00000050-abc123", ".tmp-step-00000090-2",
        "v00000001.safetensors", "v00000002.safetensors", "v00000003.safetensors",  # 9, 7, 5 days
        ".v00000003.safetensors.ab12.tmp",
        "train-0.log.1", "produce-0.log.2.gz"}                       # 5 and 9 days; the live log is 0.5
    actions = plan_gc(run, GcPolicy(keep_checkpoints=1, keep_weights=1, older_than_s=3.5 * DAY_S), NOW)
    assert _names(actions) == {
        "step-00000100", "step-00000200", "step-00000300", "step-00000400",  # 500 is newest; 400 is 4 days
        ".del-step-00000050-abc123", ".tmp-step-00000090-2",         # 3 days > the 6 h grace of tmp dirs
        "v00000001.safetensors", "v00000002.safetensors", "v00000003.safetensors",  # v4 is 3 days: kept
        ".v00000003.safetensors.ab12.tmp",
        "train-0.log.1", "produce-0.log.2.gz", "spans.jsonl.1", "trainer-0.jsonl"}


def test_apply_removes_exactly_the_plan(run):
    from stream_rl.storage.checkpoint import complete_checkpoints

    actions = plan_gc(run, GcPolicy(keep_checkpoints=2, keep_weights=2, older_than_s=5 * DAY_S), NOW)
    done = apply_gc(actions)
    assert done == actions
    assert all(not os.path.lexists(a.path) for a in actions)
    assert [p.name for p in complete_checkpoints(run.checkpoint_dir)] == ["step-00000400", "step-00000500"]
    assert sorted(p.name for p in run.checkpoint_dir.iterdir()) == [
        ".tmp-step-00000700-1", "step-00000400", "step-00000500", "step-00000600"]
    assert sorted(p.name for p in run.weights_dir.iterdir()) == [
        ".v00000002.safetensors.ef56.tmp", ".v00000006.safetensors.cd34.tmp", "notes.txt",
        "v00000004.safetensors", "v00000005.safetensors"]
    run_dir = run.checkpoint_dir.parent
    for kept in ("config.yaml", "metrics.jsonl", "trained.jsonl", "spans.jsonl", "logs/train-0.log"):
        assert (run_dir / kept).is_file(), kept
    assert apply_gc(actions) == []  # already gone: skipped, no error


def test_policy_refuses_to_remove_the_newest():
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 1"):
        GcPolicy(keep_checkpoints=0, keep_weights=1)
    with pytest.raises(ValueError, match="keep_weights must be >= 1"):
        GcPolicy(keep_checkpoints=1, keep_weights=0)


def test_missing_directories_plan_nothing(tmp_path):
    paths = GcPaths(tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d.jsonl", tmp_path / "e")
    assert plan_gc(paths, GcPolicy(1, 1, older_than_s=0.0), NOW) == []


def test_cli_dry_run_removes_nothing_then_gc_removes(run):
    run_dir = run.checkpoint_dir.parent
    runner = CliRunner()
    before = _tree(run_dir)
    args = ["gc", "--run-dir", str(run_dir), "--keep-checkpoints", "2", "--keep-weights", "4"]
    dry = runner.invoke(app, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert _tree(run_dir) == before
    assert "would remove checkpoint" in dry.output and "step-00000300" in dry.output
    assert "step-00000400" not in dry.output
    assert "v00000001.safetensors" in dry.output and "v00000002.safetensors" not in dry.output
    real = runner.invoke(app, args)
    assert real.exit_code == 0, real.output
    assert "removed 7 item(s)" in real.output  # 3 checkpoints, .del, old .tmp, weights v1, abandoned v3 tmp
    assert not (run.checkpoint_dir / "step-00000300").exists()
    assert (run.weights_dir / "v00000002.safetensors").exists()
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "nothing to remove" in again.output
    bad = runner.invoke(app, ["gc", "--run-dir", str(run_dir), "--keep-weights", "0"])
    assert bad.exit_code == 2 and "keep_weights must be >= 1" in bad.output
