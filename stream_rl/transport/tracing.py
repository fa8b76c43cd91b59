"""The tracing edge: OpenTelemetry spans for sending and processing records, W3C context in Kafka headers.

Consumes: a :class:`~stream_rl.config.TracingConfig` (exporter choice) and record headers (``list[(str, bytes)]``).
Produces: spans (``send <topic>`` as PRODUCER, ``process <name>`` as CONSUMER) exported to nowhere, the console, a
JSON-lines file or OTLP, and ``traceparent``/``tracestate`` headers on every record sent.
Guarantees: context is carried whatever the exporter (the "none" exporter still records span context, it only
exports nothing); a span that processes one record is a child of that record's producer span; a span that processes
a batch links to every record's context (and has no parent from the batch). When nothing would ever see a send span
(no exporter, no kafka-python instrumentation, the SDK's default sampler), :meth:`Tracing.send_headers` writes the
``traceparent`` such a span would have carried (trace id and sampling inherited from the current span, a fresh span id
from the provider's id generator, the same flags and ``tracestate``) without building the span: the headers on the
wire are the same, at a fraction of the cost per record. Business code never sees a span object:
the transport edge and role loops use the context managers here. No global tracer provider is installed, except
for the optional kafka-python instrumentation, which needs one and is given ours.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider, sampling
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Link, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from stream_rl.config.sections import TracingConfig

Headers = list[tuple[str, bytes]]
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = ("traceparent", "tracestate")
MAX_LINKS = 16_384
"""Links kept per span (the SDK's default, 128, would drop most of a training step's rollouts)."""


class JsonlSpanExporter(SpanExporter):
    """Writes one JSON object per finished span to a file (readable without a tracing backend)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_to_dict(s), sort_keys=True) for s in spans]
        with self._lock, open(self.path, "a") as fh:
            fh.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
                  for link in span.links],
        "service": (span.resource.attributes or {}).get("service.name"),
    }


def _exporter_for(cfg: TracingConfig, run_dir: Path | None) -> SpanExporter | None:
    if cfg.exporter == "none":
        return None
    if cfg.exporter == "console":
        return ConsoleSpanExporter()
    if cfg.exporter == "jsonl":
        return JsonlSpanExporter(cfg.jsonl_path or Path(run_dir or ".") / "spans.jsonl")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=cfg.otlp_endpoint) if cfg.otlp_endpoint else OTLPSpanExporter()


class Tracing:
    """A tracer provider for one process plus the header helpers the transport edge needs."""

    def __init__(self, service_name: str, exporter: SpanExporter | None = None, *, batch: bool = False,
                 instrument_kafka_python: bool = False):
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                       span_limits=SpanLimits(max_links=MAX_LINKS))
        if exporter is not None:
            processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
            self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("stream_rl")
        self.kafka_instrumented = False
        if instrument_kafka_python:
            from opentelemetry.instrumentation.kafka import KafkaInstrumentor
            KafkaInstrumentor().instrument(tracer_provider=self.provider)
            self.kafka_instrumented = True
        self.records_spans = not (exporter is None and not self.kafka_instrumented
                                  and isinstance(self.tracer, SdkTracer) and _default_sampler(self.provider))
        """Whether a send span can be seen by anything; when False, :meth:`send_headers` stands in for it."""

    @classmethod
    def from_config(cls, cfg: TracingConfig, service_name: str, run_dir: Path | None = None) -> Tracing:
        return cls(service_name, _exporter_for(cfg, run_dir), batch=cfg.exporter == "otlp",
                   instrument_kafka_python=cfg.instrument_kafka_python)

    def shutdown(self) -> None:
        self.provider.shutdown()

    @contextmanager
    def send_span(self, topic: str, key: bytes | None, headers: Headers,
                  attributes: dict[str, Any] | None = None) -> Iterator[Headers]:
        """A PRODUCER span around one send; yields ``headers`` with this span's W3C context added. When
        :attr:`records_spans` is False nothing would see the span: the transport edge calls :meth:`send_headers`
        instead, which writes the same headers without building it."""
        attrs = {"messaging.system": "kafka", "messaging.destination.name": topic, **(attributes or {})}
        with self.tracer.start_as_current_span(f"send {topic}", kind=SpanKind.PRODUCER, attributes=attrs):
            out = [(k, v) for k, v in headers if k not in _TRACE_HEADERS]
            if not self.kafka_instrumented:  # the instrumentation injects on its own
                carrier: dict[str, str] = {}
                _PROPAGATOR.inject(carrier)
                out.extend((k, v.encode()) for k, v in carrier.items())
            yield out

    def send_headers(self, headers: Headers) -> Headers:
        """``headers`` (less any trace headers) plus the W3C context of a new child of the current span, built as
        the SDK's ``start_span`` builds it under the default sampler (ParentBased(ALWAYS_ON)): the parent's trace
        id, sampling decision and ``tracestate``, or a new trace, sampled, for a root. Only for
        ``records_spans == False``: no span object exists, nothing is exported."""
        parent = trace.get_current_span().get_span_context()
        ids = self.provider.id_generator
        if parent.is_valid:
            trace_id, state = parent.trace_id, parent.trace_state
            flags = (TraceFlags.SAMPLED if parent.trace_flags.sampled else TraceFlags.DEFAULT) | (
                TraceFlags.RANDOM_TRACE_ID if parent.trace_flags.random_trace_id else 0)
        else:
            trace_id, state = ids.generate_trace_id(), None
            flags = TraceFlags.SAMPLED | (TraceFlags.RANDOM_TRACE_ID if ids.is_trace_id_random() else 0)
        out = [(k, v) for k, v in headers if k not in _TRACE_HEADERS]
        out.append(("traceparent", f"00-{trace_id:032x}-{ids.generate_span_id():016x}-{flags:02x}".encode()))
        if state:
            out.append(("tracestate", state.to_header().encode()))
        return out

    @contextmanager
    def process_span(self, name: str, headers_list: Sequence[Headers],
                     attributes: dict[str, Any] | None = None) -> Iterator[None]:
        """A CONSUMER span for processing records: child of the one record's context, else linked to every one.
        When :attr:`records_spans` is False no span is built and no record's context is read for links (nobody
        would see them): the current context becomes what that span's would have been (:meth:`_bare_context`)."""
        if not self.records_spans:
            with trace.use_span(self._bare_context(headers_list), end_on_exit=False):
                yield
            return
        contexts = [c for c in (extract_span_context(h) for h in headers_list) if c is not None]
        attrs = {"messaging.system": "kafka", "messaging.batch.message_count": len(headers_list),
                 **(attributes or {})}
        if len(headers_list) == 1 and contexts:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(contexts[0]))
            with self.tracer.start_as_current_span(f"process {name}", context=parent, kind=SpanKind.CONSUMER,
                                                   attributes=attrs):
                yield
            return
        links = [Link(c) for c in contexts]
        with self.tracer.start_as_current_span(f"process {name}", kind=SpanKind.CONSUMER, links=links,
                                               attributes=attrs, context=trace.set_span_in_context(
                                                   trace.INVALID_SPAN)):
            yield

    def _bare_context(self, headers_list: Sequence[Headers]) -> trace.NonRecordingSpan:
        """The context a ``process`` span would have under the default sampler, without the span: a child of the
        one record's context (its trace, sampling and ``tracestate``), else a new sampled root."""
        ids = self.provider.id_generator
        parent = extract_span_context(headers_list[0]) if len(headers_list) == 1 else None
        if parent is not None:
            return trace.NonRecordingSpan(trace.SpanContext(
                parent.trace_id, ids.generate_span_id(), is_remote=False, trace_flags=parent.trace_flags,
                trace_state=parent.trace_state))
        flags = TraceFlags.SAMPLED | (TraceFlags.RANDOM_TRACE_ID if ids.is_trace_id_random() else 0)
        return trace.NonRecordingSpan(trace.SpanContext(ids.generate_trace_id(), ids.generate_span_id(),
                                                        is_remote=False, trace_flags=TraceFlags(flags)))

    @contextmanager
    def span(self, name: str, attributes: dict[str, Any] | None = None) -> Iterator[None]:
        """An internal span (a stage inside a role step), child of the current span."""
        with self.tracer.start_as_current_span(name, attributes=attributes or {}):
            yield


def _default_sampler(provider: TracerProvider) -> bool:
    """Whether ``provider`` samples as the SDK does by default (``OTEL_TRACES_SAMPLER`` unset or the default)."""
    return provider.sampler.get_description() == sampling.DEFAULT_ON.get_description()


def current_headers() -> Headers:
    """The current span's W3C context as Kafka headers (empty when no span is recording), so work done later can
    open a span that continues it (``process_span(name, [these headers])``)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return [(k, v.encode()) for k, v in carrier.items()]


def extract_span_context(headers: Headers | None) -> trace.SpanContext | None:
    """The remote span context carried by ``traceparent`` in ``headers``, or None."""
    carrier = {k: v.decode("latin-1") for k, v in (headers or []) if k in _TRACE_HEADERS}
    if "traceparent" not in carrier:
        return None
    ctx = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return ctx if ctx.is_valid else None
