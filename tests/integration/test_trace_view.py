"""`stream-rl trace show` on spans written by the real transport edge and scorer loop on the real broker: one tree
per rollout (producer send -> scorer process -> scored send; a train-step span linking to the scored records).
Percentiles, the rollout filter and the missing-file error: tests/unit/test_trace_summary.py."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from support import messages as samples
from typer.testing import CliRunner

from stream_rl.cli.main import app
from stream_rl.operator_tools.trace_view import load_spans, rollout_view


@pytest.mark.broker
def test_spans_of_the_real_edge_and_scorer_form_one_tree_per_rollout(make_config, tmp_path):
    from consumers.scorer.scorer import ScorerDeps, run_scorer
    from stream_rl.config.sections import TracingConfig
    from stream_rl.transport.client import Transport
    from stream_rl.transport.tracing import Tracing

    spans_path = tmp_path / "run" / "spans.jsonl"
    cfg = make_config(**{"scorer.reward_fn": "stream_rl.demo.task:addition_reward", "scorer.poll_timeout_s": 0.5,
                         "tracing.exporter": "jsonl", "topics.partitions": {"rollouts": 1, "scored": 1}})

    def tracing(service):
        return Tracing.from_config(TracingConfig(exporter="jsonl", jsonl_path=spans_path), service)

    producer = Transport(cfg, "producer", tracing=tracing("producer"))
    producer.ensure_topics()
    sink = producer.sink()
    rollouts = [replace(samples.rollout(1, s, version=2), prompt_text="1+1=", response_text="2") for s in range(2)]
    with producer.tracing.process_span("generate", [[]]):
        for rollout in rollouts:
            sink.send(producer.names.rollouts, rollout, key=rollout.group_id)
    sink.flush()
    sink.close()
    scorer_tracing = tracing("scorer")
    stats = run_scorer(cfg, cfg.scorer, max_batches=1, deps=ScorerDeps(tracing=scorer_tracing))
    assert stats.scored == 2
    trainer = Transport(cfg, "trainer", tracing=tracing("trainer"))
    tsink = trainer.sink()
    source = trainer.source([trainer.names.scored], "trace-test-trainer", "scored_rollout", tsink)
    records, deadline = [], time.monotonic() + 30
    while len(records) < 2 and time.monotonic() < deadline:
        records += source.poll(0.5)
    with source.process_span("train-step", records, {"stream_rl.step": 0}):
        pass
    source.close()
    tsink.close()
    for t in (producer.tracing, scorer_tracing, trainer.tracing):
        t.shutdown()

    spans = load_spans(tmp_path / "run")
    assert "1+1=" not in spans_path.read_text()  # no prompt text in any span
    rid = rollouts[0].rollout_id
    lines = rollout_view(spans, rid)
    names = [line.lstrip("│├└─ ").split(" [")[0] for line in lines]
    rollouts_topic, scored_topic = producer.names.rollouts, producer.names.scored
    assert names[1:7] == ["process generate", f"send {rollouts_topic}", "process score", f"send {scored_topic}",
                          "linked from:", "process score-batch"], lines  # the scorer's batch links to the send
    assert names[7:] == ["process train-step"], lines
    assert "[producer]" in lines[2] and "[scorer]" in lines[3] and "[trainer]" in lines[-1]
    assert f"rollout_id={rid}" in lines[2] and "policy_version.min=2" in lines[2] and "response_tokens=5" in lines[2]
    assert "reward=1.0" in lines[4]  # the addition verifier: "2" answers "1+1="
    send = next(s for s in spans if s["name"] == f"send {rollouts_topic}"
                and s["attributes"]["stream_rl.rollout_id"] == rid)
    score = next(s for s in spans if s["parent_id"] == send["span_id"])
    scored_send = next(s for s in spans if s["parent_id"] == score["span_id"])
    assert (score["name"], scored_send["name"]) == ("process score", f"send {scored_topic}")
    assert len({send["trace_id"], score["trace_id"], scored_send["trace_id"]}) == 1
    step = next(s for s in spans if s["name"] == "process train-step")
    assert scored_send["span_id"] in {link["span_id"] for link in step["links"]} and len(step["links"]) == 2
    shown = CliRunner().invoke(app, ["trace", "show", str(tmp_path / "run"), "--rollout", rid])
    assert shown.exit_code == 0 and shown.stdout.strip().splitlines() == lines
    summary_out = CliRunner().invoke(app, ["trace", "show", str(tmp_path / "run"), "--limit", "1"])
    assert summary_out.exit_code == 0 and "process train-step" in summary_out.stdout
    assert {json.loads(line)["service"] for line in spans_path.read_text().splitlines()} == {
        "producer", "scorer", "trainer"}
