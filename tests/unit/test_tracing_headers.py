"""The span-less ``traceparent`` of a tracer whose spans nobody sees is the one a real send span would carry.

Each case builds the same situation twice: with an in-memory exporter (``records_spans``: the SDK builds the send
span and injects it) and without one (``send_headers`` writes the header directly), and compares what reaches the
wire: version, trace id, flags and ``tracestate`` equal, a fresh 16-hex span id, other headers kept.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from stream_rl.transport.tracing import Tracing, extract_span_context


def _parts(headers):
    by_name = dict(headers)
    version, trace_id, span_id, flags = by_name["traceparent"].decode().split("-")
    return {"version": version, "trace": trace_id, "span_len": len(span_id), "flags": flags,
            "state": by_name.get("tracestate"), "others": {k: v for k, v in by_name.items()
                                                           if k not in ("traceparent", "tracestate")}}


def _sent_headers(tracing: Tracing, parent: SpanContext | None, headers):
    """The headers a send under ``parent`` (None: no current span) gets from ``tracing``."""
    if parent is None:
        with tracing.send_span("topic", b"k", headers) as out:
            return out
    with trace.use_span(NonRecordingSpan(parent)):
        with tracing.send_span("topic", b"k", headers) as out:
            return out


def _compare(parent: SpanContext | None) -> dict:
    recorded = Tracing("svc", InMemorySpanExporter())
    bare = Tracing("svc")
    assert recorded.records_spans and not bare.records_spans
    headers = [("x", b"1"), ("traceparent", b"00-" + b"0" * 31 + b"1-" + b"0" * 15 + b"1-01")]
    real, fast = _parts(_sent_headers(recorded, parent, headers)), _parts(_sent_headers(bare, parent, headers))
    assert real["trace"] != "0" * 31 + "1"  # the stale traceparent given by the caller is replaced
    if parent is not None:
        assert real["trace"] == fast["trace"] == f"{parent.trace_id:032x}"
    assert {k: v for k, v in real.items() if k != "trace"} == {k: v for k, v in fast.items() if k != "trace"}
    return fast


def test_a_root_send_is_sampled_with_a_random_trace_id_as_the_sdk_does():
    fast = _compare(None)
    assert fast["version"] == "00" and fast["span_len"] == 16 and fast["others"] == {"x": b"1"}
    assert fast["flags"] == "03"


def test_a_child_inherits_trace_sampling_and_tracestate():
    state = TraceState([("vendor", "abc")])
    sampled = SpanContext(0x1234, 0x99, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=state)
    fast = _compare(sampled)
    assert fast["flags"] == "01" and fast["state"] == b"vendor=abc"
    unsampled = SpanContext(0x5678, 0x98, is_remote=True, trace_flags=TraceFlags(TraceFlags.DEFAULT))
    assert _compare(unsampled)["flags"] == "00"


def test_every_send_gets_a_new_span_id_that_a_process_span_can_parent_on():
    exporter = InMemorySpanExporter()
    consumer_side = Tracing("consumer", exporter)
    bare = Tracing("producer")
    first, second = (bare.send_headers([]) for _ in range(2))
    assert extract_span_context(first).span_id != extract_span_context(second).span_id
    with consumer_side.process_span("score", [first]):
        pass
    (span,) = exporter.get_finished_spans()
    assert span.parent.span_id == extract_span_context(first).span_id
    assert span.context.trace_id == extract_span_context(first).trace_id


def test_inside_a_process_span_the_send_continues_its_trace():
    bare = Tracing("svc")
    with bare.process_span("generate", [[]]):
        current = trace.get_current_span().get_span_context()
        headers = bare.send_headers([])
    assert extract_span_context(headers).trace_id == current.trace_id
    assert extract_span_context(headers).span_id != current.span_id


def _processed_then_sent(tracing: Tracing, batch):
    """The headers of a send made while processing ``batch`` (a list of record headers)."""
    with tracing.process_span("step", batch):
        if tracing.records_spans:
            with tracing.send_span("out", b"k", []) as out:
                return out
        return tracing.send_headers([])


def test_processing_one_record_continues_its_trace_without_building_a_span():
    state = TraceState([("vendor", "abc")])
    for flags, expected in ((TraceFlags.SAMPLED, "01"), (TraceFlags.DEFAULT, "00")):
        parent = SpanContext(0xABC, 0x77, is_remote=True, trace_flags=TraceFlags(flags), trace_state=state)
        record = [("traceparent", f"00-{parent.trace_id:032x}-{parent.span_id:016x}-{expected}".encode()),
                  ("tracestate", b"vendor=abc")]
        real = _parts(_processed_then_sent(Tracing("svc", InMemorySpanExporter()), [record]))
        fast = _parts(_processed_then_sent(Tracing("svc"), [record]))
        assert real == fast and fast["trace"] == f"{0xABC:032x}" and fast["flags"] == expected
        assert fast["state"] == b"vendor=abc"


def test_processing_a_batch_starts_a_new_sampled_trace_without_reading_links():
    batch = [[("traceparent", f"00-{i + 1:032x}-{i + 1:016x}-01".encode())] for i in range(3)]
    real = _parts(_processed_then_sent(Tracing("svc", InMemorySpanExporter()), batch))
    fast = _parts(_processed_then_sent(Tracing("svc"), batch))
    assert fast["trace"] not in {f"{i + 1:032x}" for i in range(3)}  # a new root, as the recorded span is
    assert {k: v for k, v in real.items() if k != "trace"} == {k: v for k, v in fast.items() if k != "trace"}
    assert fast["flags"] == "03"
