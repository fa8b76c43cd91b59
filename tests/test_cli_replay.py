"""`stream-rl topics list` and `stream-rl replay` through the CLI against the real broker."""

from __future__ import annotations

import json

import pytest
import samples
from typer.testing import CliRunner

from stream_rl.cli.main import app
from stream_rl.transport.client import Transport

pytestmark = pytest.mark.broker


def _args(cfg):
    return ["--bootstrap", cfg.kafka.bootstrap_servers, "--run", cfg.topics.run]


def test_topics_list_and_replay(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 2}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    rollouts = [samples.rollout(i) for i in range(3)]
    for i, r in enumerate(rollouts):
        sink.send(t.names.rollouts, r, key=r.group_id, partition=i % 2)
    sink.send_raw(t.names.rollouts, b"not msgpack \xc1", partition=0)
    sink.flush()
    runner = CliRunner()

    listed = runner.invoke(app, ["topics", "list", "--json", *_args(cfg)])
    assert listed.exit_code == 0, listed.output
    rows = {r["topic"]: r for r in map(json.loads, listed.output.splitlines())}
    assert rows[t.names.rollouts]["partitions"] == 2
    assert rows[t.names.rollouts]["records"] == 4
    assert rows[t.names.rollouts]["highwaters"] == [3, 1]
    assert rows[t.names.scored]["records"] == 0

    out = runner.invoke(app, ["replay", "rollouts", "--partition", "0", *_args(cfg)])
    assert out.exit_code == 0, out.output
    lines = [json.loads(x) for x in out.output.splitlines()]
    assert [x["offset"] for x in lines] == [0, 1, 2]
    assert lines[0]["value"]["rollout_id"] == rollouts[0].rollout_id
    assert lines[0]["value"]["response_token_ids"] == rollouts[0].response_token_ids.tolist()
    assert lines[0]["value"]["response_text"].startswith("<redacted: ")
    assert "SECRET-RESPONSE" not in out.output
    assert "error" in lines[2] and lines[2]["value_bytes"] == len(b"not msgpack \xc1")

    shown = runner.invoke(app, ["replay", "rollouts", "--partition", "0", "--from-offset", "1", "--limit", "1",
                                "--show-text", *_args(cfg)])
    assert shown.exit_code == 0
    (line,) = [json.loads(x) for x in shown.output.splitlines()]
    assert line["offset"] == 1 and line["value"]["response_text"] == "SECRET-RESPONSE"

    bad = runner.invoke(app, ["replay", "rollouts", "--partition", "9", *_args(cfg)])
    assert bad.exit_code == 1 and "no partition 9" in bad.output
