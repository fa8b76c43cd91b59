"""Configuration of a role's metrics, health endpoints and heartbeats (``cfg.telemetry``).

Consumes: nothing (a pydantic section, validated when the root config is loaded).
Produces: :class:`TelemetryConfig`, read by every role process.
Guarantees: every field has bounds; the HTTP server binds to 127.0.0.1 unless ``http_host`` says otherwise; a
tracker in ``trackers`` whose package is not installed is a config error naming the extra (checked with
``importlib.util.find_spec``: nothing is imported).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from stream_rl.config.base import Section
from stream_rl.telemetry.trackers import missing_packages


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
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, max_length=3, description="experiment trackers the trainer logs to at every step "
        "(any subset; extra .[trackers]): tensorboard (event files under tracker_dir), wandb (offline under "
        "tracker_dir unless WANDB_MODE/WANDB_API_KEY say online), mlflow (a local store under tracker_dir, or "
        "MLFLOW_TRACKING_URI)")
    tracker_project: str = Field("stream-rl", min_length=1, max_length=128, description="W&B project and MLflow "
                                 "experiment of the tracker runs; the run name is topics.run")
    tracker_dir: Path | None = Field(None, description="where the trackers write and keep their run ids "
                                     "(default: run_dir/trackers)")
    tracker_queue: int = Field(10_000, ge=1, le=1_000_000, description="per tracker: most calls waiting for its "
                               "background thread; when full, new calls are dropped and counted (the trainer "
                               "never waits on a tracker)")
    tracker_retry_s: float = Field(5.0, gt=0, le=3600, description="first wait before retrying a failing "
                                   "tracker; doubles per failure up to 60x")
    log_samples: int = Field(0, ge=0, description="every this many steps, a sample table (prompt, response, "
                             "reward of the step's rollouts) goes to the trackers; 0: never")
    log_sample_rows: int = Field(8, ge=1, le=1024, description="most rows of one sample table")
    log_sample_content: bool = Field(False, description="sample tables show the prompt and response text; by "
                                     "default each text is replaced by '<redacted: N chars>', as stream-rl replay "
                                     "does")

    @field_validator("trackers")
    @classmethod
    def _installed(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"a tracker is listed twice: {value}")
        missing = missing_packages(value)
        if missing:
            raise ValueError(f"{', '.join(missing)} not installed: pip install 'stream-rl[trackers]' (or remove "
                             f"it from telemetry.trackers)")
        return value
