"""The scorer's configuration section (``cfg.scorer``).

Consumes: values from the config file, ``STREAM_RL_SCORER__*`` environment variables and ``--set scorer.x=y``.
Produces: a validated :class:`ScorerConfig`.
Guarantees: at least one reward source (a rule-based function or a reward model) is configured; a reward
function reference is syntactically ``module:function`` (whether it imports is checked when the scorer starts,
see :mod:`stream_rl.rewards.contract`); weights are finite; ``device`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``
(whether that CUDA device exists is checked when the models load, see :mod:`stream_rl.models.devices`). The
removed ``half_precision`` is refused with its replacement (``dtype``). Nothing heavy is imported here.

How the reward is combined (one rule, no options to get wrong)::

    reward = reward_fn_weight * r_fn + reward_model_weight * r_rm
    reward_components = {"reward_fn": reward_fn_weight * r_fn, "reward_model": reward_model_weight * r_rm}

so the components always sum to the reward; a source that is not configured contributes no component.

Routed rewards (``scorer.rewards``, see docs/rewards.md) replace the single ``reward_fn``: each rollout's
``metadata[rewards.by]`` picks a list of ``{fn, weight}`` (``rewards.routes``, else ``rewards.default``), and the
rule-based part becomes ``sum_i weight_i * r_i`` with one component per function, named by its ``fn``. Setting
both ``rewards`` and ``reward_fn`` is refused (one of the two decides the rule-based reward); with ``rewards`` set
and ``reward_fn`` left out, ``reward_fn`` is None and ``reward_fn_weight`` is unused. A reward model still adds
``reward_model_weight * r_rm``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from schemas.ids import ID_PATTERN
from stream_rl.config.base import DEVICE_PATTERN, Section
from stream_rl.rewards.names import DEFAULT_REWARD_FN  # declared once, in the rewards' registry
from stream_rl.rewards.settings import (CALL_PREFIX, CallPolicy, JudgeSettings, RewardsConfig, check_backoff,
                                        routes_replace_reward_fn)


class JudgeConfig(Section, JudgeSettings):
    """An LLM judge behind an OpenAI-compatible chat-completions endpoint (stream_rl.rewards.judge).

    Its fields are the core's :class:`stream_rl.rewards.settings.JudgeSettings` (declared there once), plus the
    weight of its score in the scorer's sum."""

    model_config = ConfigDict(frozen=False)  # a section, as every other (JudgeSettings alone is frozen)
    weight: float = Field(1.0, allow_inf_nan=False, ge=-1e6, le=1e6, description="weight of the judge's score")


class ScorerConfig(Section):
    """``stream-rl score``: rewards and reference log-probabilities for every rollout."""

    reward_fn: str | None = Field(
        DEFAULT_REWARD_FN,
        description="rule-based reward as 'package.module:function', called as fn(prompt, response, answer, "
                    "metadata) -> float | {'reward': float, 'token_rewards': [R floats]}; None: no rule-based reward")
    rewards: RewardsConfig | None = Field(
        None, description="rewards routed by a metadata value (replaces reward_fn, which must then be left out); "
                          "None: reward_fn for every rollout")
    reward_fn_weight: float = Field(
        1.0, allow_inf_nan=False, description="weight of the rule-based reward in the sum")
    reward_model_dir: Path | None = Field(
        None, description="local directory of a one-label sequence classifier (save_pretrained layout); None: none")
    reward_model_weight: float = Field(
        1.0, allow_inf_nan=False, description="weight of the reward model's score in the sum")
    reward_model_input: Literal["tokens", "text"] = Field(
        "tokens", description="'tokens': feed prompt+response token ids (reward model shares the policy's "
                              "tokenizer); 'text': re-tokenise prompt_text+response_text with the model's tokenizer")
    reference_model_dir: Path | None = Field(
        None, description="local directory of the frozen reference policy; None: no reference log-probabilities")
    batch_size: int = Field(
        16, ge=1, le=4096, description="rollouts polled and scored per batch (also the model forward batch)")
    poll_timeout_s: float = Field(1.0, gt=0, le=60, description="longest wait for rollouts in one poll")
    batches_in_flight: int = Field(
        1, ge=1, le=64, description="batches scored at once: with > 1 the scorer polls the next batch while the "
                                    "reward calls of earlier ones are in flight (a slow reward service or judge no "
                                    "longer serialises the scorer); results are sent and offsets committed in poll "
                                    "order, each batch after its own outputs were acknowledged")
    token_level_rewards: bool = Field(
        False, description="attach per-token rewards: the function's 'token_rewards' if it returns them, else "
                           "the sequence reward on the last response token (plus the reward model's score there)")
    scorer_id: str | None = Field(
        None, pattern=ID_PATTERN.pattern, description="id written into every scored rollout; None: the "
                                                      "transport's instance id (scorer-<random>)")
    REMOVED = {"half_precision": "scorer.half_precision was removed: set scorer.dtype ('bfloat16' for what "
                                 "half_precision=true did, 'float32' for false)"}
    device: str = Field("auto", pattern=DEVICE_PATTERN,
                        description="torch device of the reference and reward models; 'auto': cuda when torch sees "
                                    "a GPU, else cpu; or cpu, cuda, cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="weights and compute dtype of the reference and reward models (frozen: no fp32 "
                               "master copy); ref_logprobs and reward scores are float32 either way")

    reward_url: str | None = Field(
        None, max_length=2000, pattern=r"^https?://",
        description="an HTTP reward server (stream-rl reward-server or any server of docs/reward-services.md's "
                    "protocol); its reward is the 'reward_server' component; None: none")
    reward_url_weight: float = Field(1.0, allow_inf_nan=False, ge=-1e6, le=1e6,
                                     description="weight of the reward server's reward in the sum")
    reward_url_batch_size: int | None = Field(
        None, ge=1, le=4096, description="rollouts per request to the reward server (requests run side by side "
                                         "up to reward_concurrency); None: the whole polled batch in one request")
    reward_headers_env: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="HTTP header -> name of the environment variable holding its value (values never logged)")
    judge: JudgeConfig | None = Field(None, description="an LLM judge; its score is the 'judge' component")
    # the reward-call policy: the core's CallPolicy fields (declared there once) under a reward_ prefix
    reward_timeout_s: float = CallPolicy.field("timeout_s")
    reward_concurrency: int = CallPolicy.field("concurrency")
    reward_isolation: Literal["thread", "process"] = Field(
        "thread", description="where rule-based reward functions run: 'thread' (in the scorer's process) or "
                              "'process' (reward_concurrency worker processes per function: a call that stalls, "
                              "e.g. a regex backtracking on a degenerate response, is killed at reward_timeout_s "
                              "and cannot freeze the scorer; ~0.07 ms more per call)")
    reward_max_retries: int = CallPolicy.field("max_retries")
    reward_backoff_s: float = CallPolicy.field("backoff_s")
    reward_max_backoff_s: float = CallPolicy.field("max_backoff_s")
    on_reward_error: Literal["dead_letter", "zero"] = Field(
        "dead_letter", description="a reward call that times out or fails for good: 'dead_letter' the rollout "
                                   "with the reason, or 'zero' (that reward counts 0; counted in the metrics)")

    @field_validator("reward_fn")
    @classmethod
    def _reference_syntax(cls, value: str | None) -> str | None:
        if value is not None:
            from stream_rl.rewards.names import check_name

            check_name(value)  # a built-in short name or module:function; RewardFnError (a ValueError) says why
        return value

    @model_validator(mode="before")
    @classmethod
    def _rewards_replace_reward_fn(cls, data: Any) -> Any:
        return routes_replace_reward_fn(data, "scorer")

    @model_validator(mode="after")
    def _some_reward_source(self) -> ScorerConfig:
        if self.reward_fn is None and self.rewards is None and self.reward_model_dir is None \
                and self.reward_url is None and self.judge is None:
            raise ValueError("the scorer needs a reward source: set reward_fn, rewards, reward_model_dir, "
                             "reward_url and/or judge")
        check_backoff(self.reward_backoff_s, self.reward_max_backoff_s, prefix="scorer." + CALL_PREFIX)
        return self

    @property
    def call_policy(self) -> CallPolicy:
        """The core's :class:`~stream_rl.rewards.settings.CallPolicy` of the ``reward_*`` fields."""
        return CallPolicy.of(self)
