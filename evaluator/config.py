"""Configuration of the held-out evaluator (``cfg.eval``; the root config holds ``eval: EvalConfig | None``).

Consumes: nothing (a pydantic section, validated when the root config is loaded).
Produces: :class:`EvalConfig`, read by :func:`evaluator.role.run_evaluator` and ``stream-rl evaluate``.
Guarantees: every field has a description and bounds; ``k`` above ``n`` and a malformed reward function are
refused at load time naming the field (an empty ``sets``, when the evaluator starts:
:func:`evaluator.step.load_sets`); no heavy import (torch) happens here. The policy engine itself is
built from ``producer`` (engine, model_dir, device, dtype): the evaluator is part of the producers role.
"""

from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator, model_validator

from schemas import ID_PATTERN
from stream_rl.config.base import Section
from stream_rl.evaluation.scoring import check_reward_fn
from stream_rl.rewards.names import DEFAULT_REWARD_FN
from stream_rl.rewards.settings import RewardsConfig, routes_replace_reward_fn

if TYPE_CHECKING:
    from stream_rl.rewards.routing import RewardRoutes

SET_NAME = r"^[A-Za-z0-9_.-]+$"


class EvalConfig(Section):
    """``stream-rl evaluate`` (and ``run`` with an ``[eval]`` section): held-out evaluation of policy versions."""

    REMOVED = {"reward_routes": "eval.reward_routes was replaced by eval.rewards, the scorer's routing shape "
                                "(scorer.rewards): [eval.rewards] by = \"data_source\", routes = {gsm8k = "
                                "[{fn = \"gsm8k\"}]}, default = [{fn = ...}] (docs/evaluation.md)"}

    sets: dict[str, Path] = Field(
        default_factory=dict, description="held-out prompt sets: name -> prompt file (any format `prompts load` "
        "reads); metrics are named <set>/<metric>. Empty: the built demo's held-out split (run.demo_dir/"
        "eval_prompts.jsonl) when the demo is used, else an error when the evaluator starts")
    every_versions: int = Field(
        20, ge=1, le=1_000_000, description="evaluate every version v with v % every_versions == 0 (the evaluator "
                                            "lags behind and skips due versions when it is slower, saying which)")
    before_train: bool = Field(True, description="also evaluate version 0, the initial weights")
    n: int = Field(4, ge=1, le=1024, description="sampled responses per prompt (mean@n, pass@k, maj@k)")
    k: list[int] = Field(default_factory=lambda: [1], min_length=1, max_length=32,
                         description="pass@k / maj@k for each k listed (1 <= k <= n)")
    greedy: bool = Field(True, description="also decode one greedy response per prompt (greedy/accuracy)")
    temperature: float = Field(1.0, ge=0.01, le=100.0, description="sampling temperature of the n responses")
    max_new_tokens: int = Field(32, ge=1, le=65536, description="response token budget")
    max_prompts: int | None = Field(
        None, ge=1, description="evaluate at most the first this many prompts of each set (cost); None: all")
    batch_size: int = Field(64, ge=1, le=4096, description="prompts generated together in one engine call")
    seed: int = Field(0, ge=0, description="sampling seed: every version is evaluated on the same random streams")
    reward_fn: str | None = Field(
        DEFAULT_REWARD_FN, description="reward of a response: a built-in verifier (gsm8k, math_boxed, "
        "multiple_choice) or 'package.module:function' with the scorer's contract fn(prompt, response, answer, "
        "metadata) -> float | {'reward': float}; left out when rewards is set")
    rewards: RewardsConfig | None = Field(
        None, description="rewards routed by a metadata value, in the scorer's shape (scorer.rewards: by, routes "
                          "value -> [{fn, weight}], default); replaces reward_fn, which must then be left out; a "
                          "response with no route and no default counts as a reward error; None: reward_fn for "
                          "every response")
    correct_at: float = Field(
        1.0, allow_inf_nan=False, description="a response counts as correct (pass@k, maj@k, greedy/accuracy) "
                                              "when its reward is >= this")
    extractor: str | None = Field(
        None, description="answer extractor for maj@k: a verifier name (stream_rl.rewards.verifiers) or "
                          "'last_number'; None: no maj@k")
    source_key: str = Field("data_source", min_length=1, description="prompt metadata key naming its data source "
                                                                     "(metrics per source when a set has several; "
                                                                     "routing is eval.rewards.by)")
    poll_timeout_s: float = Field(2.0, gt=0.0, le=600.0, description="longest wait for a new weights version")
    evaluator_id: str | None = Field(
        None, pattern=ID_PATTERN.pattern, max_length=255,
        description="id written into every Evaluation record; None: the transport's instance id")

    @field_validator("sets")
    @classmethod
    def _set_names(cls, value: dict[str, Path]) -> dict[str, Path]:
        import re

        for name in value:
            if not re.match(SET_NAME, name):
                raise ValueError(f"eval.sets: set name {name!r} must match {SET_NAME}")
        return value

    @field_validator("reward_fn")
    @classmethod
    def _reference(cls, value: str | None) -> str | None:
        return None if value is None else check_reward_fn(value)

    @model_validator(mode="before")
    @classmethod
    def _rewards_replace_reward_fn(cls, data: Any) -> Any:
        return routes_replace_reward_fn(data, "eval")

    def scoring_routes(self) -> RewardRoutes:
        """What scores a response: ``rewards``' routes, else ``reward_fn`` as the one default route."""
        from stream_rl.evaluation.scoring import single_route

        if self.rewards is not None:
            return self.rewards.to_routes("eval.rewards")
        assert self.reward_fn is not None  # _some_reward
        return single_route(self.reward_fn)

    @model_validator(mode="after")
    def _some_reward(self) -> EvalConfig:
        if self.reward_fn is None and self.rewards is None:
            raise ValueError("eval needs a reward: set eval.reward_fn or eval.rewards")
        return self

    @model_validator(mode="after")
    def _k_within_n(self) -> EvalConfig:
        bad = [k for k in self.k if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"eval.k: {bad} outside 1..eval.n = {self.n} (pass@k needs k <= n samples)")
        return self
