"""The root configuration: every role's section on top of the shared ones, and the rules across them.

Consumes: :class:`stream_rl.config.shared.SharedConfig` (the core's sections) and each role's section
(:mod:`producers.config`, :mod:`consumers.scorer.config`, :mod:`consumers.trainer.config`).
Produces: :class:`StreamRLConfig` (what every command resolves), :func:`load_config` (defaults < file <
environment < flags, :func:`stream_rl.config.loading.resolve_config`) and :func:`config_warnings`.
Guarantees: an impossible combination across sections is refused at load time (so ``--dry-run`` refuses it), the
error naming both fields and where their values came from. This module sits above the roles (the CLI layer): the
core and the roles take a config as :class:`~stream_rl.config.shared.SharedConfig` plus their own section and
never import it. ``python -m stream_rl.cli.config`` prints docs/configuration.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from consumers.scorer.config import ScorerConfig
from consumers.trainer.config import PPO_RANGE_CLIP, TrainerConfig
from producers.config import ProducerConfig
from evaluator.config import EvalConfig
from producers.driver.config import DriverConfig
from producers.gateway.config import GatewayConfig
from stream_rl.config.base import CrossFieldError, Section
from stream_rl.config.loading import resolve_config
from stream_rl.config.shared import Agreements, SharedConfig
from stream_rl.launch.gpus import GpuLayout, RoleCounts, layout_errors
from stream_rl.launch.servers import ServersSpec, memory_share

ELASTIC_REMOVED = ("run.placement='elastic' was removed: its lease (the trainer's update on the idle roles' cores) "
                   "measured 1.03x 'auto' on the demo, within the noise (docs/architecture.md, \"Elastic placement: "
                   "designed, measured, removed\"); use 'auto'")


class RunConfig(Section):
    """`stream-rl run`: how many processes of each role, which prompts, and when to stop."""

    producers: int = Field(1, ge=1, description="producer processes")
    scorers: int = Field(1, ge=1, description="scorer processes (one consumer group)")
    trainer_ranks: int = Field(1, ge=1, description="data-parallel trainer ranks (stream-rl train --nproc N): rank 0 "
                                                   "consumes and checkpoints, every rank trains its share")
    demo_dir: Path | None = Field(Path("runs/demo-model"), description="built-in demo: built here by `run` "
                                  "when missing, and used for the policy, reference and prompts left at their "
                                  "defaults (also by produce/score/train started by hand, once built); None (in a file, which has no "
                                  "null: \"none\"): no demo")
    prompts_file: Path | None = Field(None, description="the prompts: a JSON-lines or Parquet file, a datasets "
                                      "directory, or a named source (reasoning-gym:NAME?size=N&seed=S, "
                                      "verifiers:TASKSET?size=N; docs/prompts.md); default: the demo's prompts.jsonl")
    epochs: int = Field(10, ge=1, description="passes over the prompt file loaded onto the prompts topic")
    group_size: int = Field(8, ge=1, description="samples per prompt written into each Prompt record")
    max_wall_s: float | None = Field(None, gt=0, description="stop the run after this many seconds")
    start_broker: bool = Field(True, description="start the local broker when kafka.bootstrap_servers is unset")
    gpus: GpuLayout | None = Field(None, description="GPUs per role (CUDA_VISIBLE_DEVICES of each process) and "
                                   "their memory shares, e.g. [run.gpus] producers = \"0-5\", trainer = \"6-7\" "
                                   "(stream_rl/launch/gpus.py, docs/operations.md); None: roles see the "
                                   "environment's GPUs")
    placement: Literal["auto", "none"] = Field(
        "auto", description="'auto': once training starts each trainer rank runs on cores of its own (with their "
        "threads), producers on the rest (1 thread each), scorers and the local broker where the kernel finds "
        "room, and the prompts/rollouts/scored topics get one partition per consumer unless topics.partitions is "
        "set (stream_rl/launch/placement.py); 'none': nothing pinned, one thread per process ('elastic' was "
        "removed: docs/architecture.md)")
    servers: ServersSpec | None = Field(
        None, description="with producer.engine = \"server\": the vllm serve processes `run` starts and stops "
        "(stream_rl/launch/servers.py); each producer gets its own share of them. None: the producers use "
        "producer.server.urls / urls_file as given")

    @field_validator("placement", mode="before")
    @classmethod
    def _elastic_removed(cls, value: object) -> object:
        if value == "elastic":
            raise ValueError(ELASTIC_REMOVED)
        return value

    @field_validator("demo_dir", mode="before")
    @classmethod
    def _none_demo(cls, value: object) -> object:
        """A config file cannot write null: ``demo_dir = "none"`` means no demo."""
        return None if isinstance(value, str) and value.strip().lower() in ("none", "null", "") else value


class StreamRLConfig(SharedConfig):
    """The root configuration shared by every role; each role reads its own section.

    Rules across sections are checked here, at load time (so ``--dry-run`` refuses them), each error naming both
    fields and where their values came from; the list is in docs/configuration.md ("Refused combinations and rules across sections").
    """

    producer: ProducerConfig = Field(default_factory=ProducerConfig)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    eval: EvalConfig | None = Field(None, description="held-out evaluation (stream-rl evaluate; `run` starts the "
                                                        "evaluator when this section is set); None: no evaluation")
    gateway: GatewayConfig | None = Field(None, description="OpenAI-compatible endpoint for black-box agents "
                                          "(stream-rl gateway; `run` starts it when this section is set, "
                                          "docs/agents.md); None: no gateway")
    driver: DriverConfig | None = Field(None, description="verifiers environments played by their own agent loop "
                                        "through the gateway (stream-rl drive; `run` starts it, against its "
                                        "gateway, when this section is set; docs/agents.md); None: no driver")

    @model_validator(mode="after")
    def _across_sections(self) -> StreamRLConfig:
        ahead, lag = self.producer.versions_ahead, self.trainer.max_lag
        if self.producer.max_groups_per_version is not None and ahead > lag:  # versions_ahead acts only then
            raise CrossFieldError(("producer.versions_ahead", "trainer.max_lag"), (
                f"producer.versions_ahead={ahead} > trainer.max_lag={lag}: producers would generate rollouts the "
                f"trainer must drop as stale; keep versions_ahead below max_lag (equal is allowed, see "
                f"docs/configuration.md)"))
        partial_lag = self.producer.partial_max_lag
        if partial_lag is not None and partial_lag > lag:
            raise CrossFieldError(("producer.partial_max_lag", "trainer.max_lag"), (
                f"producer.partial_max_lag={partial_lag} > trainer.max_lag={lag}: resumed rollouts would reach the "
                f"trainer too old and be dropped as stale; keep partial_max_lag at most max_lag"))
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
        for fields, message in layout_errors(self.run.gpus, gpu_counts(self)) if self.run.gpus else ():
            raise CrossFieldError(fields, message)  # run.gpus against the roles' counts (stream_rl/launch/gpus.py)
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
        self._driver_rule()
        self._keep_best_rule()
        self._servers_rule()
        return self

    def _driver_rule(self) -> None:
        """A ``[driver]`` plays through a gateway it can reach: ``driver.gateway_url``, or the run's own gateway on a
        port known before it starts."""
        if self.driver is None or self.driver.gateway_url is not None:
            return
        if self.gateway is None:
            raise CrossFieldError(("driver.gateway_url", "gateway"), (
                "a [driver] needs a gateway to play through: add a [gateway] section (stream-rl run starts it) or "
                "set driver.gateway_url to a running one"))
        if self.gateway.port == 0:
            raise CrossFieldError(("driver.gateway_url", "gateway.port"), (
                "gateway.port = 0 (a free port, chosen at start) leaves the driver no address: set gateway.port, "
                "or driver.gateway_url"))

    def _servers_rule(self) -> None:
        """``producer.engine = "server"`` needs servers; a server belongs to one producer."""
        servers, server = self.run.servers, self.producer.server
        if self.producer.engine != "server":
            return  # [run.servers] is then unused (config_warnings says so)
        if servers is None and not server.urls and server.urls_file is None:
            raise CrossFieldError(("producer.engine", "producer.server.urls"), (
                "producer.engine = 'server' needs servers: producer.server.urls, producer.server.urls_file, or "
                "[run.servers] for `stream-rl run` to start them"))
        drivers = self.run.producers + (1 if self.gateway is not None else 0)
        if servers is not None and servers.count < drivers:
            raise CrossFieldError(("run.servers.count", "run.producers"), (
                f"run.servers.count={servers.count} < run.producers={self.run.producers}"
                f"{' + 1 for the gateway' if self.gateway is not None else ''}: each producer (and the gateway) "
                f"drives servers of its own (a server holds one driver's weights version)"))

    def _keep_best_rule(self) -> None:
        """``trainer.keep_best`` names a metric an evaluation of a configured set produces
        (:func:`stream_rl.evaluation.best.keep_best_problem`); the built demo's held-out set is ``heldout``."""
        from stream_rl.evaluation.best import keep_best_problem, set_metric_names

        if self.trainer.keep_best is None:
            return
        if self.eval is None:
            raise CrossFieldError(("trainer.keep_best", "eval"), (
                f"trainer.keep_best={self.trainer.keep_best!r} needs an [eval] section: no evaluation runs"))
        ev = self.eval
        sets = list(ev.sets) or (["heldout"] if self.run.demo_dir is not None else [])
        names = set_metric_names(ev.n, ev.k, ev.greedy, ev.extractor is not None)
        problem = keep_best_problem(self.trainer.keep_best, sets, names)
        if problem is not None:
            raise CrossFieldError(("trainer.keep_best", "eval.sets"), problem)



def gpu_counts(cfg: StreamRLConfig) -> RoleCounts:
    """What ``run.gpus`` is checked against: the role counts and the producers' vLLM parallelism and share."""
    vllm = cfg.producer.engine == "vllm"
    servers = cfg.run.servers if cfg.producer.engine == "server" else None  # started by `stream-rl run`
    return RoleCounts(cfg.run.producers, cfg.run.scorers, cfg.run.trainer_ranks, cfg.eval is not None,
                      cfg.producer.vllm.tensor_parallel_size if vllm else 1,
                      cfg.producer.vllm.gpu_memory_utilization if vllm else None,
                      servers=servers.devices() if servers is not None else (),
                      server_share=memory_share(servers.extra_args) if servers is not None else 0.0)


def agreements(cfg: StreamRLConfig) -> Agreements:
    """What the trainer must follow of the other roles' sections (:class:`stream_rl.config.shared.Agreements`):
    the producers' engine dtype and the evaluator's cadence (defaults without an [eval] section)."""
    ev = cfg.eval
    return Agreements(weights_dtype=cfg.producer.dtype,
                      eval_every_versions=ev.every_versions if ev is not None else 1,
                      eval_before_train=ev.before_train if ev is not None else True)


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> StreamRLConfig:
    """Resolve the root config: defaults < file (``path``, else ``$STREAM_RL_CONFIG``) < environment (``env``,
    default ``os.environ``) < ``overrides`` (CLI flags, dotted keys). Raises ConfigError naming every bad field."""
    return resolve_config(path, env, overrides, model=StreamRLConfig)


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
    if cfg.run.servers is not None and cfg.producer.engine != "server":
        out.append(f"[run.servers] is set but producer.engine = {cfg.producer.engine!r}: no server is started "
                   f"(the servers are for producer.engine = 'server')")
    return out



if __name__ == "__main__":
    from stream_rl.config.doc import config_reference

    print(config_reference(StreamRLConfig), end="")
