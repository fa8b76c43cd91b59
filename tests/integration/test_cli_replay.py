"""`stream-rl topics list` and `stream-rl replay` through the CLI against the real broker: sample content redacted
by default (texts, answers, token ids, metadata values, prompt-bearing ids and keys, quoted values in dead-letter
reasons), joinable hashes, and everything as is with `--show-content`."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from support import messages as samples
from typer.testing import CliRunner

from schemas import DeadLetter
from stream_rl.cli.main import app
from stream_rl.transport.client import Transport

pytestmark = pytest.mark.broker
HASHED = re.compile(r"^#[0-9a-f]{16}$")


def _args(cfg, tmp_path):
    return ["--bootstrap", cfg.kafka.bootstrap_servers, "--run", cfg.topics.run,
            "--set", f"broker.state_dir={tmp_path / 'state'}"]  # where the id-hash key is kept


def _lines(result) -> list[dict]:
    assert result.exit_code == 0, result.output
    return [json.loads(x) for x in result.stdout.splitlines()]


def test_topics_list_and_replay(make_config, tmp_path):
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

    listed = runner.invoke(app, ["topics", "list", "--json", *_args(cfg, tmp_path)])
    assert listed.exit_code == 0, listed.output
    rows = {r["topic"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert rows[t.names.rollouts]["partitions"] == 2
    assert rows[t.names.rollouts]["records"] == 4
    assert rows[t.names.rollouts]["highwaters"] == [3, 1]
    assert rows[t.names.scored]["records"] == 0

    out = runner.invoke(app, ["replay", "rollouts", "--partition", "0", *_args(cfg, tmp_path)])
    lines = _lines(out)
    assert [x["offset"] for x in lines] == [0, 1, 2]
    assert lines[0]["value"]["epoch"] == 0 and lines[0]["value"]["sample_index"] == 0
    assert lines[0]["value"]["response_text"].startswith("<redacted: ")
    assert "SECRET-RESPONSE" not in out.output
    assert "error" in lines[2] and lines[2]["value_bytes"] == len(b"not msgpack \xc1")

    shown = runner.invoke(app, ["replay", "rollouts", "--partition", "0", "--from-offset", "1", "--limit", "1",
                                "--show-content", *_args(cfg, tmp_path)])
    (line,) = _lines(shown)
    assert line["offset"] == 1 and line["value"]["response_text"] == "SECRET-RESPONSE"
    assert line["value"]["rollout_id"] == rollouts[2].rollout_id and line["key"] == rollouts[2].group_id

    bad = runner.invoke(app, ["replay", "rollouts", "--partition", "9", *_args(cfg, tmp_path)])
    assert bad.exit_code == 1 and "no partition 9" in bad.output


def test_replay_redacts_every_field_that_carries_content(make_config, tmp_path):
    """With a character tokenizer the token ids spell the text out, and the demo's prompt ids (add-12-34) are the
    question: none of it may appear without --show-content, while the ids stay joinable."""
    cfg = make_config(**{"topics.partitions": {"prompts": 1, "rollouts": 1, "scored": 1, "dlq": 1, "stale": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    spelled = np.array([ord(c) for c in "SECRETANSWER"], dtype=np.int32)
    prompt = replace(samples.prompt(7), prompt_id="add-12-34", text="12+34=", answer="forty-six",
                     metadata={"source": "SECRET-SOURCE"}, prompt_token_ids=spelled)
    rollout = replace(samples.rollout(7, sample=3), prompt_id="add-12-34", group_id="add-12-34:0",
                      rollout_id="add-12-34:0:3", response_token_ids=spelled,
                      behavior_logprobs=np.full(len(spelled), -0.5, dtype=np.float32),
                      token_policy_versions=np.full(len(spelled), 3, dtype=np.int64), answer="forty-six")
    scored = replace(samples.scored(7, 3), rollout=rollout, token_rewards=None,
                     ref_logprobs=np.full(len(spelled), -0.25, dtype=np.float32))
    letter = DeadLetter.of_value(b"\x81\xa4text\xa6SECRET", 4096, reason="invalid rollout.prompt_id: malformed id "
                                 "'add 12 34' (must match ...)", error_type="SchemaError", source_topic="x",
                                 source_partition=0, source_offset=5, raw_key=b"add-12-34:0", consumer_id="scorer-0")
    sink.send(t.names.prompts, prompt, key=prompt.prompt_id)
    sink.send(t.names.rollouts, rollout, key=rollout.group_id)
    sink.send(t.names.scored, scored, key=rollout.group_id)
    sink.send(t.names.dlq, letter, key="add-12-34:0")
    sink.flush()
    runner = CliRunner()
    got = {topic: _lines(runner.invoke(app, ["replay", topic, *_args(cfg, tmp_path)]))[0]
           for topic in ("prompts", "rollouts", "scored", "dlq")}
    text = json.dumps(got)
    for needle in ("add-12-34", "12+34", "forty-six", "SECRET", "add 12 34", json.dumps(spelled.tolist())[1:-1]):
        assert needle not in text, needle
    p, r, s = got["prompts"]["value"], got["rollouts"]["value"], got["scored"]["value"]["rollout"]
    assert HASHED.match(p["prompt_id"]) and got["prompts"]["key"] == p["prompt_id"]
    assert p["text"] == "<redacted: 6 chars>" and p["answer"] == "<redacted: 9 chars>"
    assert p["metadata"] == {"source": "<redacted: 13 chars>"} and p["prompt_token_ids"] == "<redacted: 12 tokens>"
    # joinable: one prompt id, one hash, across topics and invocations; the epoch and sample index stay
    assert r["prompt_id"] == s["prompt_id"] == p["prompt_id"]
    assert r["group_id"] == f"{p['prompt_id']}:0" == got["rollouts"]["key"] == got["dlq"]["key"]
    assert r["rollout_id"] == f"{p['prompt_id']}:0:3" == s["rollout_id"]
    assert r["response_token_ids"] == "<redacted: 12 tokens>" and r["answer"] == "<redacted: 9 chars>"
    assert r["behavior_logprobs"] == [-0.5] * 12 and got["scored"]["value"]["reward"] == 1.0  # numbers stay
    d = got["dlq"]["value"]
    assert d["reason"] == "invalid rollout.prompt_id: malformed id <redacted: 11 chars> (must match ...)"
    assert d["raw_value"].startswith("<redacted: ") and d["raw_sha256"] == letter.raw_sha256
    again = _lines(runner.invoke(app, ["replay", "prompts", *_args(cfg, tmp_path)]))[0]
    assert again["value"]["prompt_id"] == p["prompt_id"]  # the key file keeps hashes stable

    shown = {topic: _lines(runner.invoke(app, ["replay", topic, "--show-content", *_args(cfg, tmp_path)]))[0]
             for topic in ("prompts", "rollouts", "dlq")}
    assert shown["prompts"]["value"]["prompt_id"] == "add-12-34" and shown["prompts"]["value"]["answer"] == "forty-six"
    assert shown["rollouts"]["value"]["response_token_ids"] == spelled.tolist()
    assert shown["rollouts"]["key"] == "add-12-34:0" and "'add 12 34'" in shown["dlq"]["value"]["reason"]
