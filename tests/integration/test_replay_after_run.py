"""``stream-rl replay`` after ``stream-rl run`` has ended (issue 40, item 5): the run stopped the local broker it
started, and replay starts it again on its durable store, reads the run's records and stops it; a memory broker's
records are gone, which replay says in one line.

A durable broker of this test's own (its state directory in tmp_path) plays the run's: a prompt is published on
a run's topic as ``run`` publishes it, the broker is stopped as ``run`` stops it, then the real CLI replays."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from stream_rl import broker as broker_mod
from stream_rl.cli.config import load_config
from stream_rl.cli.main import app
from stream_rl.prompts import PromptRow, prompt_messages, publish_prompts
from stream_rl.transport.client import Transport

pytestmark = pytest.mark.broker


def test_replay_after_the_run_ended_starts_the_durable_broker_and_stops_it(tmp_path, run_name, monkeypatch):
    monkeypatch.delenv("STREAM_RL_KAFKA__BOOTSTRAP_SERVERS", raising=False)
    state_dir = tmp_path / "broker"
    cfg = load_config(None, env={}, overrides={"broker.state_dir": str(state_dir), "broker.storage": "durable",
                                               "topics.run": run_name, "run_dir": str(tmp_path / "run")})
    broker_mod.up(cfg.broker)  # what `stream-rl run` starts ...
    try:
        transport = Transport(cfg, "run")
        transport.ensure_topics()
        row = PromptRow("p1", "1+1=", "2", {"data_source": "demo"}, 1)
        assert publish_prompts(transport, prompt_messages([row], epochs=1, group_size=2)) == 1
    finally:
        broker_mod.down(cfg.broker)  # ... and stops when it ends
    assert not broker_mod.status(cfg.broker)[0]

    out = CliRunner().invoke(app, ["replay", "prompts", "--run", run_name, "--show-content",
                                   "--set", f"broker.state_dir={state_dir}"])
    assert out.exit_code == 0, out.output
    assert f"replay: starting the local broker on its durable store in {state_dir}" in out.stderr
    (record,) = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert record["value"]["prompt_id"] == "p1" and record["value"]["answer"] == "2"
    assert not broker_mod.status(cfg.broker)[0]  # stopped again: replay leaves things as it found them


def test_replay_says_a_memory_brokers_records_are_gone(tmp_path, monkeypatch):
    monkeypatch.delenv("STREAM_RL_KAFKA__BOOTSTRAP_SERVERS", raising=False)
    out = CliRunner().invoke(app, ["replay", "prompts", "--run", "gone", "--set", f"broker.state_dir={tmp_path}",
                                   "--set", "broker.storage=memory"])
    assert out.exit_code == 1
    assert (f"replay: no local broker runs in {tmp_path}, and its storage is 'memory': the records of a run that "
            "ended went with it") in out.output
