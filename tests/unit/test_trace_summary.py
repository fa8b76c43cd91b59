"""The trace view over a spans file: percentiles and summaries by hand, a rollout's lineage and linking step,
batch links, and the error naming a missing file."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from stream_rl.cli.main import app
from stream_rl.operator_tools.trace_view import load_spans, overview, percentile, rollout_view, summary


def _span(name, span_id, parent=None, trace="t1", start=0, ms=1.0, links=(), **attrs):
    return {"name": name, "trace_id": trace, "span_id": span_id, "parent_id": parent, "kind": "INTERNAL",
            "start_ns": start, "end_ns": start + int(ms * 1e6), "attributes": attrs, "service": "svc",
            "links": [{"trace_id": "tx", "span_id": s} for s in links]}


def test_percentiles_and_summary_match_hand_computation():
    assert percentile([40.0, 10.0, 30.0, 20.0], 50) == 25.0  # halfway between 20 and 30
    assert percentile([40.0, 10.0, 30.0, 20.0], 95) == pytest.approx(38.5)  # rank 2.85: 30 + 0.85 * 10
    assert percentile([7.0], 95) == 7.0
    spans = [_span("a", "1", ms=2.0), _span("a", "2", ms=4.0), _span("b", "3", ms=1.5)]
    assert summary(spans) == [{"name": "a", "count": 2, "p50_ms": 3.0, "p95_ms": pytest.approx(3.9)},
                              {"name": "b", "count": 1, "p50_ms": 1.5, "p95_ms": 1.5}]


def test_rollout_view_keeps_the_lineage_and_the_linking_step():
    spans = [_span("process generate", "g", start=1),
             _span("send rollouts", "s1", "g", start=2, **{"stream_rl.rollout_id": "p:0:0"}),
             _span("send rollouts", "s2", "g", start=3, **{"stream_rl.rollout_id": "p:0:1"}),
             _span("process score", "c1", "s1", start=4),
             _span("send scored", "d1", "c1", start=5, **{"stream_rl.rollout_id": "p:0:0", "stream_rl.reward": 1.0}),
             _span("process score", "c2", "s2", start=6),
             _span("process train-step", "ts", trace="t2", start=9, links=("d1", "zz"), **{"stream_rl.step": 3}),
             _span("process train-step", "other", trace="t3", start=10, links=("zz",))]
    lines = rollout_view(spans, "p:0:0")
    assert lines[0] == "trace t1"
    names = [line.lstrip("│├└─ ").split(" [")[0] for line in lines[1:]]
    assert names == ["process generate", "send rollouts", "process score", "send scored", "linked from:",
                     "process train-step"]
    assert "rollout_id=p:0:0" in lines[2] and "reward=1.0" in lines[4] and "step=3" in lines[6]
    assert lines[2].startswith("└─ ") and lines[3].startswith("   └─ ") and lines[4].startswith("      └─ ")
    with pytest.raises(Exception, match="no span carries"):
        rollout_view(spans, "p:0:9")
    text = "\n".join(overview(spans, limit=5, max_children=1))
    assert "8 spans in 3 traces" in text and "... 1 more" in text


def test_trace_show_names_the_missing_file_and_the_setting(tmp_path):
    result = CliRunner().invoke(app, ["trace", "show", str(tmp_path)])
    assert result.exit_code == 1
    assert str(tmp_path / "spans.jsonl") in result.output and "tracing.exporter=jsonl" in result.output


def test_a_batch_span_keeps_every_link(tmp_path):
    """A training step links to each of its rollouts: more than the SDK's default of 128 links must survive."""
    from stream_rl.config.sections import TracingConfig
    from stream_rl.transport.tracing import Tracing

    tracing = Tracing.from_config(TracingConfig(exporter="jsonl", jsonl_path=tmp_path / "spans.jsonl"), "svc")
    headers = []
    for _ in range(300):
        with tracing.send_span("t", None, []) as sent:
            headers.append(sent)
    with tracing.process_span("train-step", headers):
        pass
    tracing.shutdown()
    spans = load_spans(tmp_path)
    step = next(s for s in spans if s["name"] == "process train-step")
    assert {link["span_id"] for link in step["links"]} == {s["span_id"] for s in spans if s["name"] == "send t"}
    assert len(step["links"]) == 300
