"""Configuration of a role's metrics, health endpoints and heartbeats (``cfg.telemetry``).

Consumes: nothing (a pydantic section, validated when the root config is loaded).
Produces: :class:`TelemetryConfig`, read by every role process.
Guarantees: every field has bounds; the HTTP server binds to 127.0.0.1 unless ``http_host`` says otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from stream_rl.config.base import Section


class TelemetryConfig(Section):
    """Metrics exporters, the health/metrics HTTP endpoint and the heartbeat period of every role process."""

    exporters: list[Literal["jsonl", "prometheus", "otlp"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="metrics exporters: jsonl (run_dir file, the default), prometheus (GET /metrics on the HTTP "
                    "endpoint), otlp (push to otlp_endpoint)")
    jsonl_dir: Path | None = Field(None, description="directory of the per-process metrics files for exporter "
                                   "jsonl (default: run_dir/telemetry; one <instance_id>.jsonl per process)")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP metrics endpoint, e.g. "
                                      "http://collector:4318/v1/metrics")
    export_interval_s: float = Field(10.0, gt=0, description="how often metrics are exported (jsonl, otlp)")
    http: bool = Field(True, description="serve /healthz, /readyz (and /metrics with exporter prometheus)")
    http_host: str = Field("127.0.0.1", min_length=1, description="address the HTTP endpoint binds to; "
                           "0.0.0.0 only inside a container or a trusted network")
    http_port: int = Field(0, ge=0, le=65535, description="HTTP port; 0 picks a free one (written to "
                           "run_dir/endpoints/<instance_id>.json)")
    heartbeat_interval_s: float = Field(5.0, gt=0, description="period of the heartbeat on the status topic; an "
                                        "acknowledged heartbeat is also the broker-reachability fact /readyz uses")
    liveness_timeout_s: float = Field(600.0, gt=0, description="/healthz answers 503 when the role loop has not "
                                      "ticked for this long (cover the longest step, e.g. a big generation batch)")
    lag_interval_s: float = Field(10.0, gt=0, description="how often a consumer computes its lag per partition "
                                  "(high-water mark - committed offset)")
