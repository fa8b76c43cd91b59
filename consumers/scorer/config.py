"""The scorer's configuration section (``cfg.scorer``).

Consumes: values from the config file, ``STREAM_RL_SCORER__*`` environment variables and ``--set scorer.x=y``.
Produces: a validated :class:`ScorerConfig`.
Guarantees: at least one reward source (a rule-based function or a reward model) is configured; a reward
function reference is syntactically ``module:function`` (whether it imports is checked when the scorer starts,
see :mod:`consumers.scorer.rewards`); weights are finite; ``device`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``
(whether that CUDA device exists is checked when the models load, see :mod:`stream_rl.models.devices`). The
removed ``half_precision`` is refused with its replacement (``dtype``). Nothing heavy is imported here.

How the reward is combined (one rule, no options to get wrong)::

    reward = reward_fn_weight * r_fn + reward_model_weight * r_rm
    reward_components = {"reward_fn": reward_fn_weight * r_fn, "reward_model": reward_model_weight * r_rm}

so the components always sum to the reward; a source that is not configured contributes no component.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from schemas.ids import ID_PATTERN
from stream_rl.config.base import DEVICE_PATTERN, Section

DEFAULT_REWARD_FN = "stream_rl.demo.task:addition_reward"
"""The built-in demo's verifier: exact answer of a two-digit addition, reward in [0, 1]."""


class ScorerConfig(Section):
    """``stream-rl score``: rewards and reference log-probabilities for every rollout."""

    reward_fn: str | None = Field(
        DEFAULT_REWARD_FN,
        description="rule-based reward as 'package.module:function', called as fn(prompt, response, answer, "
                    "metadata) -> float | {'reward': float, 'token_rewards': [R floats]}; None: no rule-based reward")
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

    @field_validator("reward_fn")
    @classmethod
    def _reference_syntax(cls, value: str | None) -> str | None:
        if value is not None:
            from consumers.scorer.rewards import parse_reference

            parse_reference(value)  # raises RewardFnError (a ValueError) naming what is wrong
        return value

    @model_validator(mode="after")
    def _some_reward_source(self) -> ScorerConfig:
        if self.reward_fn is None and self.reward_model_dir is None:
            raise ValueError("the scorer needs a reward source: set reward_fn and/or reward_model_dir")
        return self
