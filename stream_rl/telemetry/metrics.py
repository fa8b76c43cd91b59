"""Per-process metrics through the OpenTelemetry metrics SDK: instruments, readers and exporters of one role.

Consumes: a :class:`~stream_rl.telemetry.config.TelemetryConfig`, the role and instance id, and the values the role
loop reports (records in/out, tokens, stage durations, lag per partition, staleness, step metrics, alerts).
Produces: a private ``MeterProvider`` (never the global one) with one reader per configured exporter:

- ``jsonl``: a periodic reader whose exporter appends one JSON object per export to
  ``<jsonl_dir or run_dir/telemetry>/<instance_id>.jsonl`` (``{"time", "role", "instance_id", "metrics":
  [{"name", "type", "points": [{"attributes", "value" | "count", "sum", "bounds", "buckets"}]}]}``);
- ``prometheus``: an OpenTelemetry Prometheus reader on a private ``CollectorRegistry``; :meth:`prometheus_text`
  renders it for ``GET /metrics``;
- ``otlp``: a periodic reader pushing to ``otlp_endpoint`` over OTLP/HTTP.

Guarantees: instrument names are the Prometheus names of ``docs/telemetry.md`` exactly (unit-less instruments, so no
suffix is added; counters already end in ``_total``); every series carries ``role`` and ``instance_id``; process
RSS and GPU memory (only when CUDA is available) are read at collection time, not in the loop; recording is a
handful of counter adds per batch (no per-token work). OpenTelemetry drops non-finite measurements, so a NaN/Inf
trainer metric is absent from the export of that step (``stream_rl_trainer_metric`` is an observable gauge over the
latest row's finite values) and the non-finite alerts report it.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    Gauge, Histogram, MetricExporter, MetricExportResult, MetricsData,
    PeriodicExportingMetricReader, Sum)
from opentelemetry.sdk.resources import Resource

from stream_rl.telemetry.config import TelemetryConfig
from stream_rl.telemetry.heartbeat import finite_metrics

SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                   600.0)
VERSION_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def process_rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``; peak RSS from getrusage where there is none)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def gpu_memory_bytes() -> dict[int, tuple[int, int]]:
    """``{device: (allocated, reserved)}`` from torch's caching allocator; empty without CUDA or torch loaded."""
    import sys

    torch = sys.modules.get("torch")  # never import torch just to find there is no GPU
    if torch is None or not torch.cuda.is_available():
        return {}
    return {d: (int(torch.cuda.memory_allocated(d)), int(torch.cuda.memory_reserved(d)))
            for d in range(torch.cuda.device_count())}


class JsonlMetricExporter(MetricExporter):
    """Appends one JSON line per export (all metrics of the process at that moment) to a file."""

    def __init__(self, path: Path, role: str, instance_id: str):
        super().__init__(preferred_temporality={})
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.role, self.instance_id = role, instance_id
        self._lock = threading.Lock()

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        row = {"time": time.time(), "role": self.role, "instance_id": self.instance_id,
               "metrics": metrics_to_dicts(metrics_data)}
        with self._lock, open(self.path, "a") as fh:
            fh.write(json.dumps(row, sort_keys=True, allow_nan=False) + "\n")
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        return None


def metrics_to_dicts(metrics_data: MetricsData) -> list[dict[str, Any]]:
    """Plain JSON-able form of one collection: name, type and points (attributes + value or histogram)."""
    out = []
    for rm in metrics_data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                data = metric.data
                points = []
                for p in data.data_points:
                    point: dict[str, Any] = {"attributes": dict(p.attributes or {})}
                    if isinstance(data, Histogram):
                        point.update(count=p.count, sum=_finite_or_none(float(p.sum)),
                                     bounds=list(p.explicit_bounds), buckets=list(p.bucket_counts))
                    else:
                        point["value"] = _finite_or_none(float(p.value))
                    points.append(point)
                kind = ("histogram" if isinstance(data, Histogram) else "gauge" if isinstance(data, Gauge)
                        else "counter" if isinstance(data, Sum) and data.is_monotonic else "sum")
                out.append({"name": metric.name, "type": kind, "points": points})
    return out


class RoleMetrics:
    """The instruments of one role process. ``close()`` exports a last time and shuts the readers down."""

    def __init__(self, cfg: TelemetryConfig, role: str, instance_id: str, run_dir: Path | None):
        self.role, self.instance_id = role, instance_id
        self.base = {"role": role, "instance_id": instance_id}
        self._registry = None
        readers = []
        interval_ms = cfg.export_interval_s * 1000.0
        if "jsonl" in cfg.exporters:
            self.jsonl_path = Path(cfg.jsonl_dir or Path(run_dir or ".") / "telemetry") / f"{instance_id}.jsonl"
            readers.append(PeriodicExportingMetricReader(JsonlMetricExporter(self.jsonl_path, role, instance_id),
                                                         export_interval_millis=interval_ms))
        else:
            self.jsonl_path = None
        if "prometheus" in cfg.exporters:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry(auto_describe=True)
            readers.append(PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False,
                                                  registry=self._registry))
        if "otlp" in cfg.exporters:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter(endpoint=cfg.otlp_endpoint) if cfg.otlp_endpoint else OTLPMetricExporter()
            readers.append(PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms))
        resource = Resource.create({"service.name": f"stream-rl-{role}", "service.instance.id": instance_id})
        self.provider = MeterProvider(metric_readers=readers, resource=resource)
        self._build_instruments(self.provider.get_meter("stream_rl"))
        self._closed = False

    def _build_instruments(self, meter) -> None:
        counter, gauge = meter.create_counter, meter.create_gauge
        self.records_in = counter("stream_rl_records_in_total", description="records fetched, per topic")
        self.records_out = counter("stream_rl_records_out_total", description="records sent, per topic")
        self.tokens = counter("stream_rl_tokens_total", description="response tokens generated (producer), "
                              "scored (scorer) or trained on (trainer)")
        self.errors = counter("stream_rl_errors_total", description="errors by type")
        self.dead_letters = counter("stream_rl_dead_letters_total", description="records dead-lettered, per "
                                    "source topic")
        self.restarts = counter("stream_rl_restarts_total", description="resumes from a checkpoint and consumer "
                                "group rebalances after the first assignment")
        self.processing = meter.create_histogram(
            "stream_rl_processing_seconds", description="duration of a processing stage",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS)
        self.staleness = meter.create_histogram(
            "stream_rl_staleness_versions", description="policy versions between a rollout's oldest token and the "
            "trainer's version (trainer), or between the producer's weights and the newest manifest (producer)",
            explicit_bucket_boundaries_advisory=VERSION_BUCKETS)
        self.lag = gauge("stream_rl_consumer_lag_records", description="high-water mark - committed offset")
        self.position_lag = gauge("stream_rl_consumer_position_lag_records",
                                  description="high-water mark - next offset this process reads")
        self.policy_version = gauge("stream_rl_policy_version", description="weights version the process holds")
        self.trainer_step = gauge("stream_rl_trainer_step", description="optimizer steps done")
        self._step_values: dict[str, float] = {}
        meter.create_observable_gauge("stream_rl_trainer_metric", callbacks=[self._observe_step_values],
                                      description="every per-step trainer metric (metrics.jsonl keys in label "
                                      "name); a non-finite value leaves its series absent until it is finite")
        self.alerts_firing = gauge("stream_rl_alerts_firing", description="1 while the alert fires, else 0")
        meter.create_observable_gauge("stream_rl_process_rss_bytes", callbacks=[self._observe_rss],
                                      description="resident set size of the process")
        meter.create_observable_gauge("stream_rl_gpu_memory_allocated_bytes", callbacks=[self._observe_gpu(0)],
                                      description="torch CUDA memory allocated, per device")
        meter.create_observable_gauge("stream_rl_gpu_memory_reserved_bytes", callbacks=[self._observe_gpu(1)],
                                      description="torch CUDA memory reserved, per device")

    # -- recording (called by the role loop through RoleTelemetry) ---------------------------------------------

    def add_records_in(self, topic: str, n: int) -> None:
        self.records_in.add(n, {**self.base, "topic": topic})

    def add_records_out(self, topic: str, n: int) -> None:
        self.records_out.add(n, {**self.base, "topic": topic})

    def add_tokens(self, n: int) -> None:
        self.tokens.add(n, self.base)

    def add_error(self, error_type: str, n: int = 1) -> None:
        self.errors.add(n, {**self.base, "type": error_type})

    def add_dead_letter(self, topic: str) -> None:
        self.dead_letters.add(1, {**self.base, "topic": topic})

    def add_restart(self) -> None:
        self.restarts.add(1, self.base)

    def observe_seconds(self, stage: str, seconds: float) -> None:
        self.processing.record(seconds, {**self.base, "stage": stage})

    def observe_staleness(self, values: Iterable[int]) -> None:
        for v in values:
            self.staleness.record(v, self.base)

    def set_lag(self, group: str, lags: Mapping[tuple[str, int], int], position: bool = False) -> None:
        gauge = self.position_lag if position else self.lag
        for (topic, partition), value in lags.items():
            gauge.set(value, {**self.base, "group": group, "topic": topic, "partition": str(partition)})

    def set_policy_version(self, version: int) -> None:
        self.policy_version.set(version, self.base)

    def set_step_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.trainer_step.set(step, self.base)
        # OpenTelemetry drops non-finite measurements: such a metric is absent from this export (the metrics.jsonl
        # row has null, and the loss_nonfinite / grad_norm_nonfinite alerts fire)
        self._step_values = finite_metrics(metrics)

    def set_alerts(self, states: Mapping[str, bool]) -> None:
        for name, firing in states.items():
            self.alerts_firing.set(1 if firing else 0, {**self.base, "name": name})

    # -- collection ----------------------------------------------------------------------------------------------

    def _observe_step_values(self, options: CallbackOptions) -> Sequence[Observation]:
        return [Observation(v, {**self.base, "name": k}) for k, v in self._step_values.items()]

    def _observe_rss(self, options: CallbackOptions) -> Sequence[Observation]:
        return [Observation(process_rss_bytes(), self.base)]

    def _observe_gpu(self, index: int):
        def callback(options: CallbackOptions) -> Sequence[Observation]:
            return [Observation(pair[index], {**self.base, "device": str(d)})
                    for d, pair in gpu_memory_bytes().items()]
        return callback

    def prometheus_text(self) -> bytes | None:
        """The Prometheus text exposition of every instrument, or None when exporter prometheus is off."""
        if self._registry is None:
            return None
        from prometheus_client import generate_latest

        return generate_latest(self._registry)

    def close(self) -> None:
        """Export once more (jsonl/otlp) and shut the readers down; idempotent."""
        if not self._closed:
            self._closed = True
            self.provider.shutdown()


__all__ = ["RoleMetrics", "JsonlMetricExporter", "metrics_to_dicts", "process_rss_bytes", "gpu_memory_bytes"]
