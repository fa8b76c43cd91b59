"""Run selection (`stream_rl/cli/runs.py`) for the commands that read topics: the newest run's topics on the real
broker, and an unknown run listed against the runs in runs/ and on the broker. Run selection and `--dry-run` without a
broker: tests/unit/test_cli_run_selection.py.
"""

from __future__ import annotations

import json
import os

import pytest
from support.runs import NEWEST, make_runs
from typer.testing import CliRunner

from stream_rl.cli.main import app

runner = CliRunner()


@pytest.mark.broker
def test_topic_commands_pick_the_newest_run_and_know_the_broker_runs(tmp_path, monkeypatch, make_config, broker):
    from support import messages as samples

    from stream_rl.transport.client import Transport

    cfg = make_config()
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    sink.send(t.names.rollouts, samples.rollout(1), key=samples.rollout(1).group_id)
    sink.flush()
    monkeypatch.chdir(tmp_path)
    make_runs(tmp_path, ("demo-20261130-235959", NEWEST))
    newest = tmp_path / "runs" / NEWEST / "config.yaml"
    stamp = newest.stat().st_mtime
    newest.write_text(f"topics:\n  run: {cfg.topics.run}\n")  # the run directory of this test's topics
    os.utime(newest, (stamp, stamp))
    env = {"STREAM_RL_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap}
    replayed = runner.invoke(app, ["replay", "rollouts", "--limit", "5"], env=env)
    assert replayed.exit_code == 0, replayed.output
    assert f"run {cfg.topics.run} (newest of 2 in runs/" in replayed.stderr
    assert [json.loads(x)["value"]["epoch"] for x in replayed.stdout.splitlines()] == [0]
    listed = runner.invoke(app, ["topics", "list"], env=env)
    assert listed.exit_code == 0 and f"{t.names.rollouts}\t4\t1" in listed.stdout
    other = make_config(**{"topics.run": f"{cfg.topics.run}-b"})  # a run with topics but no directory here
    Transport(other, "test").ensure_topics()
    on_broker = runner.invoke(app, ["topics", "list", "--run", other.topics.run], env=env)
    assert on_broker.exit_code == 0, on_broker.output
    unknown = runner.invoke(app, ["replay", "rollouts", "--run", "nosuch-run"], env=env)
    assert unknown.exit_code == 2, unknown.output
    assert unknown.stderr.startswith("unknown run 'nosuch-run': runs in runs/: ")
    assert "runs on the broker: " in unknown.stderr
    # the session broker holds every test's runs: the listing names ours, or says how many it left out
    assert other.topics.run in unknown.stderr or "more: `stream-rl topics list --all`)" in unknown.stderr
    from stream_rl.cli.runs import broker_runs

    assert other.topics.run in broker_runs(cfg)
