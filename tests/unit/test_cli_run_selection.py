"""Run selection (`stream_rl/cli/runs.py`) through the CLI as a user types it, in process, and `--dry-run` on every
command.

The README's commands after `make run` name no run; `stream-rl run` names runs `demo-YYYYmmdd-HHMMSS` with the
directory `runs/<run>/`. These tests build such run directories in a temporary working directory, without a broker,
and check the newest-run default, `--run`, explicit settings winning, and exit 2 for an unknown run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from support.runs import NEWEST, make_runs
from typer.testing import CliRunner

from stream_rl.cli.main import app

runner = CliRunner()


def _spans(run_dir: Path, name: str) -> None:
    span = {"name": f"process {name}", "trace_id": "t1", "span_id": "s1", "parent_id": None, "start_ns": 0,
            "end_ns": 2_000_000, "attributes": {}, "links": [], "service": "trainer"}
    (run_dir / "spans.jsonl").write_text(json.dumps(span) + "\n")


@pytest.fixture
def runs_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STREAM_RL_CONFIG", raising=False)
    monkeypatch.delenv("STREAM_RL_TOPICS__RUN", raising=False)
    monkeypatch.delenv("STREAM_RL_RUN_DIR", raising=False)
    return make_runs(tmp_path)


def test_commands_without_a_run_take_the_newest_and_say_so(runs_cwd):
    for name, d in runs_cwd.items():
        _spans(d, name)
    shown = runner.invoke(app, ["trace", "show"])
    assert shown.exit_code == 0, shown.output
    assert f"process {NEWEST}" in shown.stdout
    assert shown.stderr.strip() == f"run {NEWEST} (newest of 3 in runs/; --run NAME to choose)"
    gc = runner.invoke(app, ["gc", "--dry-run"])
    assert gc.exit_code == 0, gc.output
    assert f"run {NEWEST} (newest of 3" in gc.stderr and "nothing to remove" in gc.stdout
    dry = runner.invoke(app, ["report", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    cfg = json.loads(dry.stdout)
    assert cfg["topics"]["run"] == NEWEST and cfg["run_dir"] == f"runs/{NEWEST}"


def test_run_flag_and_explicit_settings_win(runs_cwd):
    other = "demo-20261201-101500"
    _spans(runs_cwd[other], other)
    by_flag = runner.invoke(app, ["trace", "show", "--run", other])
    assert by_flag.exit_code == 0, by_flag.output
    assert f"process {other}" in by_flag.stdout and by_flag.stderr == ""  # given, not picked: no note
    by_set = runner.invoke(app, ["report", "--dry-run", "--set", f"topics.run={other}"])
    assert by_set.exit_code == 0 and json.loads(by_set.stdout)["run_dir"] == f"runs/{other}"
    by_dir = runner.invoke(app, ["trace", "show", str(runs_cwd[other])])  # the positional RUN_DIR
    assert by_dir.exit_code == 0 and f"process {other}" in by_dir.stdout
    elsewhere = runs_cwd[other].parent.parent / "elsewhere"
    elsewhere.mkdir()
    by_file = Path("cfg.toml")
    by_file.write_text(f'run_dir = "{elsewhere}"\n')
    from_config = runner.invoke(app, ["gc", "--dry-run", "-c", str(by_file)])
    assert from_config.exit_code == 0 and from_config.stderr == "" and "nothing to remove" in from_config.stdout


@pytest.mark.parametrize("argv", [["report"], ["gc"], ["trace", "show"], ["report", "--dry-run"]])
def test_an_unknown_run_exits_2_listing_the_runs(runs_cwd, argv):
    result = runner.invoke(app, [*argv, "--run", "demo-nosuch"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("unknown run 'demo-nosuch': runs in runs/: ")
    assert line.split(": ", 2)[2].split(", ") == [NEWEST, "demo-20261201-101500", "demo-20261130-235959"]
    assert "Traceback" not in result.output


def test_no_run_directory_is_an_error_that_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["report"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("no run to show: no run directories in runs/; start one with `stream-rl run`, "
                                     "or choose one with --run NAME")


# ------------------------------------------------------------------------------ --dry-run on every command

def _leaf_commands(group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command of the typer app as its words (groups walked: `broker up`, `trace show`, ...)."""
    out = []
    for name, cmd in sorted(group.commands.items()):
        out += _leaf_commands(cmd, (*path, name)) if hasattr(cmd, "commands") else [(*path, name)]
    return out


EVERY_COMMAND = _leaf_commands(typer.main.get_command(app))


NEEDS = {("prompts", "validate"): ["prompts.jsonl"], ("prompts", "load"): ["prompts.jsonl"],
         ("demo", "init"): ["new-demo"], ("demo", "chat-model"): ["new-chat-model"], ("plan",): ["--params", "7e9"],
         ("replay",): ["rollouts"], ("export",): ["--out", "exported"], ("rescore",): ["--to-run", "new-run"],
         ("evaluate",): ["--set", "eval.sets.heldout=prompts.jsonl"], ("reward-server",): ["gsm8k"],
         ("gateway",): ["--port", "0"],
         ("drive",): ["--set", "driver.environment=verifiers:vf_reverse", "--gateway", "http://127.0.0.1:9/v1"]}
"""Arguments a command requires besides --dry-run (every file named here exists in the working directory)."""


NOT_THE_CONFIG = {("gc",): "nothing to remove", ("plan",): '"params": 7000000000',
                  ("reward-server",): "would serve gsm8k on 127.0.0.1:0",
                  ("rescore",): '"scored_topic": "stream-rl.new-run.scored"'}
"""Commands whose --dry-run prints something else than the resolved config (gc, rescore: their plans, documented)."""


def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")}


def test_every_command_is_walked():
    assert len(EVERY_COMMAND) >= 20 and ("status",) in EVERY_COMMAND and ("broker", "down") in EVERY_COMMAND


@pytest.mark.parametrize("path", EVERY_COMMAND, ids=" ".join)
def test_dry_run_on_every_command_prints_and_touches_nothing(path, runs_cwd, tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt_id": "p1", "text": "1+1="}\n')
    before = _tree(tmp_path)
    env = {"STREAM_RL_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1",  # nothing listens: a contact would fail
           "STREAM_RL_BROKER__STATE_DIR": str(tmp_path / "broker-state")}
    result = runner.invoke(app, [*path, *NEEDS.get(path, []), "--dry-run"], env=env)
    assert result.exit_code == 0, f"{' '.join(path)} --dry-run: {result.output}"
    assert _tree(tmp_path) == before, f"{' '.join(path)} --dry-run changed files"
    if path in NOT_THE_CONFIG:
        assert NOT_THE_CONFIG[path] in result.stdout
    elif any("--config" in p.opts for p in _command(path).params):  # the resolved config, as `config` prints it
        cfg = json.loads(result.stdout)
        assert cfg["kafka"]["bootstrap_servers"] == "127.0.0.1:1" and cfg["topics"]["run"]
    else:
        assert result.stdout.strip()


def _command(path: tuple[str, ...]):
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd
