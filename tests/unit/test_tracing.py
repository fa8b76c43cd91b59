"""The tracing edge without a broker: exporters chosen by config, header injection and extraction."""

from __future__ import annotations

import json

from stream_rl.config.sections import TracingConfig
from stream_rl.transport.tracing import Tracing, extract_span_context


def test_jsonl_exporter_writes_parent_and_links(tmp_path):
    path = tmp_path / "spans.jsonl"
    tracing = Tracing.from_config(TracingConfig(exporter="jsonl", jsonl_path=path), "svc")
    with tracing.send_span("topic-a", b"k", [("x", b"1")], {"stream_rl.group_id": "g"}) as headers_a:
        pass
    with tracing.send_span("topic-a", b"k", []) as headers_b:
        pass
    assert dict(headers_a)["x"] == b"1"  # existing headers are kept
    with tracing.process_span("one", [headers_a]):
        pass
    with tracing.process_span("many", [headers_a, headers_b]):
        pass
    tracing.shutdown()
    spans = {s["name"]: s for s in map(json.loads, path.read_text().splitlines()) if s["name"] != "send topic-a"}
    sends = [s for s in map(json.loads, path.read_text().splitlines()) if s["name"] == "send topic-a"]
    assert len(sends) == 2 and all(s["kind"] == "PRODUCER" and s["service"] == "svc" for s in sends)
    assert sends[0]["attributes"]["stream_rl.group_id"] == "g"
    assert spans["process one"]["parent_id"] == sends[0]["span_id"]
    assert spans["process one"]["trace_id"] == sends[0]["trace_id"]
    assert spans["process many"]["parent_id"] is None
    assert {link["span_id"] for link in spans["process many"]["links"]} == {s["span_id"] for s in sends}


def test_traceparent_is_injected_even_without_an_exporter():
    tracing = Tracing.from_config(TracingConfig(exporter="none"), "svc")
    with tracing.send_span("t", None, []) as headers:
        pass
    ctx = extract_span_context(headers)
    assert ctx is not None and ctx.is_valid
    assert dict(headers)["traceparent"].decode().split("-")[2] == f"{ctx.span_id:016x}"
    assert extract_span_context([("other", b"x")]) is None
    assert extract_span_context([("traceparent", b"garbage")]) is None


def test_console_exporter_is_built_from_config():
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from stream_rl.transport.tracing import _exporter_for

    assert isinstance(_exporter_for(TracingConfig(exporter="console"), None), ConsoleSpanExporter)
    assert _exporter_for(TracingConfig(exporter="none"), None) is None


def test_otlp_exporter_is_built_from_config():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from stream_rl.transport.tracing import _exporter_for

    exporter = _exporter_for(TracingConfig(exporter="otlp", otlp_endpoint="http://127.0.0.1:1/v1/traces"), None)
    assert isinstance(exporter, OTLPSpanExporter)
    assert exporter._endpoint == "http://127.0.0.1:1/v1/traces"  # no span is sent: no collector runs here
