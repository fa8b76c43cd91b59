"""The sections every role reads, composed: :class:`SharedConfig`. The roles' own sections (producer, scorer,
trainer) and ``stream-rl run``'s are added on top of it by the CLI's root config,
:class:`stream_rl.cli.config.StreamRLConfig`, so the core never imports a role.

Consumes: the core's sections (Kafka, topics, tracing, telemetry, alerts, broker, weights, data).
Produces: :class:`SharedConfig`, the type core code and the roles take a config as.
Guarantees: every field of :class:`SharedConfig` is a field of the root config, with the same name and default.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from stream_rl.alerts.config import AlertsConfig
from stream_rl.config.base import Section
from stream_rl.config.data import DataConfig
from stream_rl.config.sections import BrokerConfig, KafkaConfig, TopicsConfig, TracingConfig
from stream_rl.telemetry.config import TelemetryConfig
from stream_rl.weights.config import WeightsConfig


class SharedConfig(Section):
    """The sections shared by every role; the root config adds each role's section."""

    run_dir: Path = Field(Path("runs/demo"), description="the run's directory: config, metrics, checkpoints, "
                          "logs, spans")
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    data: DataConfig = Field(default_factory=DataConfig)
