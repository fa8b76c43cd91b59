"""The scorer's configuration section (``cfg.scorer``).

Consumes: values from the config file, ``STREAM_RL_SCORER__*`` environment variables and ``--set scorer.x=y``.
Produces: a validated :class:`ScorerConfig`.
Guarantees: at least one reward source (a rule-based function or a reward model) is configured; a reward
function reference is syntactically ``module:function`` (whether it imports is checked when the scorer starts,
see :mod:`consumers.scorer.rewards`); weights are finite. Nothing heavy is imported here.

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
from stream_rl.config_base import Section

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
    half_precision: bool = Field(
        False, description="run the reference and reward models in bfloat16 (also on CPU); float32 otherwise")
    token_level_rewards: bool = Field(
        False, description="attach per-token rewards: the function's 'token_rewards' if it returns them, else "
                           "the sequence reward on the last response token (plus the reward model's score there)")
    scorer_id: str | None = Field(
        None, pattern=ID_PATTERN.pattern, description="id written into every scored rollout; None: the "
                                                      "transport's instance id (scorer-<random>)")
    device: str = Field("cpu", min_length=1, description="torch device of the models, e.g. 'cpu' or 'cuda:0'")

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
