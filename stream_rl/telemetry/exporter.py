"""What a role process exposes: its metrics (with their exporters), its health state and the HTTP endpoint.

Consumes: a :class:`~stream_rl.telemetry.config.TelemetryConfig`, the role, instance id and run directory; at run
time the counts the transport edge and the loop report (records in/out, dead letters, tokens), the weights
version and whether the model is loaded.
Produces: a :class:`~stream_rl.telemetry.metrics.RoleMetrics` (jsonl / Prometheus / OTLP exporters), a
:class:`~stream_rl.telemetry.health.HealthState`, and with ``telemetry.http`` a
:class:`~stream_rl.telemetry.health.HealthServer` (``/healthz``, ``/readyz``, ``/metrics``) recorded in
``run_dir/endpoints/<instance_id>.json``; the cumulative ``counts`` heartbeats turn into rates, and the process
gauges alerts and heartbeats read (``process/rss_bytes``, ``gpu/allocated_bytes`` with CUDA, ``dlq/total``,
``step``).
Guarantees: recording is a counter add and a dict update (no I/O in the loop); ``close`` stops the server (which
removes its endpoint file) and then exports the metrics one last time; it is idempotent.
"""

from __future__ import annotations

import time
from pathlib import Path

from stream_rl.telemetry.config import TelemetryConfig
from stream_rl.telemetry.health import HealthServer, HealthState
from stream_rl.telemetry.metrics import RoleMetrics, gpu_memory_bytes, process_rss_bytes


class RoleExporter:
    """Metrics, health state and HTTP endpoint of one role process."""

    def __init__(self, tcfg: TelemetryConfig, role: str, instance_id: str, run_dir: Path):
        self.metrics = RoleMetrics(tcfg, role, instance_id, run_dir)
        self.health = HealthState()
        self.counts = {"records_in": 0, "records_out": 0, "tokens": 0}
        self.dead_letters = 0
        self.server = None
        if tcfg.http:
            self.server = HealthServer(self.health, tcfg.http_host, tcfg.http_port,
                                       liveness_timeout_s=tcfg.liveness_timeout_s,
                                       broker_timeout_s=2 * tcfg.heartbeat_interval_s + 5.0,
                                       metrics_text=self.metrics.prometheus_text)
            self.server.record(run_dir / "endpoints", role, instance_id)

    # -- counts (the edge's and the loop's) ------------------------------------------------------------------------

    def records_in(self, topic: str, n: int) -> None:
        self.counts["records_in"] += n
        self.metrics.add_records_in(topic, n)

    def records_out(self, topic: str, n: int) -> None:
        self.counts["records_out"] += n
        self.metrics.add_records_out(topic, n)

    def dead_lettered(self, topic: str, error_type: str) -> None:
        self.dead_letters += 1
        self.metrics.add_dead_letter(topic)
        self.metrics.add_error(error_type)

    def tokens(self, n: int) -> None:
        self.counts["tokens"] += int(n)
        self.metrics.add_tokens(int(n))

    # -- health --------------------------------------------------------------------------------------------------

    def set_version(self, version: int) -> None:
        self.metrics.set_policy_version(version)
        self.health.update(version=version)

    @property
    def model_loaded(self) -> bool:
        return self.health.snapshot().model_loaded

    def tick_age(self) -> float:
        """Seconds since the loop last ticked (-1.0 before its first tick)."""
        last = self.health.snapshot().last_tick
        return time.monotonic() - last if last is not None else -1.0

    def process_gauges(self, step: int) -> dict[str, float]:
        """Memory (RSS; GPU allocated with CUDA), dead letters sent and the step, as alert keys."""
        gauges = {"process/rss_bytes": float(process_rss_bytes()), "dlq/total": float(self.dead_letters),
                  "step": float(step)}
        gpu = gpu_memory_bytes()
        if gpu:
            gauges["gpu/allocated_bytes"] = float(sum(a for a, _ in gpu.values()))
        return gauges

    def close(self) -> None:
        """Stop the HTTP server (its endpoint file goes), then export the metrics a last time (idempotent)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        self.metrics.close()
