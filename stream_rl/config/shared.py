"""The sections every role reads, composed: :class:`SharedConfig`. The roles' own sections (producer, scorer,
trainer) and ``stream-rl run``'s are added on top of it by the CLI's root config,
:class:`stream_rl.cli.config.StreamRLConfig`, so the core never imports a role.

Consumes: the core's sections (Kafka, topics, tracing, telemetry, alerts, broker, weights, data).
Produces: :class:`SharedConfig`, the type core code and the roles take a config as; :class:`Agreements`, the values
two roles must agree on; :func:`checkpoint_root`, the one rule for where the trainer's checkpoints live.
Guarantees: every field of :class:`SharedConfig` is a field of the root config, with the same name and default. A
role entry point takes this shared config plus its own section (and, where it must agree with another role, an
:class:`Agreements`): no role reads another role's section (tests/unit/test_import_layers.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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


def checkpoint_root(run_dir: Path | str, checkpoint_dir: Path | str | None) -> Path:
    """Where the trainer's checkpoints live: ``trainer.checkpoint_dir``, default ``run_dir/checkpoints``. The trainer
    writes there; export, evaluate, gc and doctor read there: all of them call this one function."""
    return Path(checkpoint_dir) if checkpoint_dir is not None else Path(run_dir) / "checkpoints"


@dataclass(frozen=True)
class Agreements:
    """Values one role's section sets and another role must follow, declared once. The CLI, the one layer that
    holds every section, builds it from the root config (:func:`stream_rl.cli.config.agreements`) and hands it to
    the role that follows: the trainer. The defaults are those of the sections they come from."""

    weights_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Floating dtype of broadcast weights: the producers' engine dtype (``producer.dtype``), which the trainer
    casts its floating tensors to before publishing a version."""
    eval_every_versions: int = 1
    """``eval.every_versions`` (1 without an [eval] section): which versions the evaluator scores, so which
    candidates ``trainer.keep_best`` holds."""
    eval_before_train: bool = True
    """``eval.before_train`` (True without an [eval] section): whether version 0 is evaluated (and held)."""
