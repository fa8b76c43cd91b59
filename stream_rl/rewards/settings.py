"""The settings of reward calls, of the LLM judge and of reward routes, declared once (pydantic; nothing heavy is
imported here).

Consumes: keyword values, from the core's callers directly (``CallPolicy(timeout_s=5.0)``) or from the roles'
config sections, which hold the same declarations (``consumers/scorer/config.py``: ``scorer.reward_*`` are
:class:`CallPolicy`'s fields under a ``reward_`` prefix, ``scorer.judge`` is a :class:`JudgeSettings`,
``scorer.rewards`` a :class:`RewardsConfig`; the evaluator's ``eval.rewards`` is a :class:`RewardsConfig` too).
Produces: :class:`CallPolicy` (deadline, concurrency, retries and backoff of every reward call, frozen) and
:class:`JudgeSettings` (what :class:`stream_rl.rewards.judge.JudgeReward` sends and how it reads the answer),
:class:`RewardsConfig` (the one routing shape, ``scorer.rewards`` and ``eval.rewards``: the metadata key, value ->
weighted functions, a default; :meth:`RewardsConfig.to_routes` gives the core's
:class:`~stream_rl.rewards.routing.RewardRoutes`).
Guarantees: each field's default, bounds and description exist here only; a value out of bounds, an unknown field,
a backoff cap below the first backoff or a judge template with fields other than {prompt}, {response}, {reference}
is a ValueError (pydantic's ``ValidationError``) naming the field when the object is built.
"""

from __future__ import annotations

import copy
import string
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from stream_rl.config.base import Section

if TYPE_CHECKING:
    from stream_rl.rewards.routing import RewardRoutes

TEMPLATE_FIELDS = frozenset({"prompt", "response", "reference"})
DEFAULT_PATTERN = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
CALL_PREFIX = "reward_"
"""The scorer's section holds :class:`CallPolicy`'s fields as ``reward_<name>`` (``scorer.reward_timeout_s``)."""


def check_backoff(backoff_s: float, max_backoff_s: float, prefix: str = "") -> None:
    """ValueError when the backoff cap is below the first backoff (names the fields with ``prefix``)."""
    if max_backoff_s < backoff_s:
        raise ValueError(f"{prefix}max_backoff_s must be >= {prefix}backoff_s")


class CallPolicy(BaseModel):
    """How every reward is called: ``scorer.reward_timeout_s``, ``reward_concurrency``, ``reward_max_retries``,
    ``reward_backoff_s``, ``reward_max_backoff_s`` (:mod:`stream_rl.rewards.calls`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(30.0, gt=0, le=3600,
                             description="deadline of one reward call attempt; past it the rollout fails")
    concurrency: int = Field(8, ge=1, le=1024, description="reward calls in flight at once, per reward")
    max_retries: int = Field(2, ge=0, le=20,
                             description="retries of a call that failed with an error marked retriable")
    backoff_s: float = Field(0.5, ge=0, le=60, description="wait before the first retry (doubles after)")
    max_backoff_s: float = Field(8.0, ge=0, le=600, description="longest wait between retries")

    @model_validator(mode="after")
    def _backoff_order(self) -> CallPolicy:
        check_backoff(self.backoff_s, self.max_backoff_s)
        return self

    @classmethod
    def field(cls, name: str) -> Any:
        """A copy of the declaration of ``name`` (default, bounds, description) for a section that holds it under
        its own name (``reward_timeout_s: float = CallPolicy.field("timeout_s")``): still declared once."""
        info: FieldInfo = cls.model_fields[name]
        return copy.deepcopy(info)  # pydantic adapts the FieldInfo it is given to the new class: never share one

    @classmethod
    def of(cls, section: Any, prefix: str = CALL_PREFIX) -> CallPolicy:
        """The policy of a section holding these fields as ``{prefix}{name}`` (a ScorerConfig)."""
        return cls(**{name: getattr(section, prefix + name) for name in cls.model_fields})


def check_template(template: str) -> str:
    """``template`` if its fields are among {prompt}, {response}, {reference}; ValueError naming the others."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"scorer.judge.template is not a format string: {exc}") from None
    unknown = sorted(fields - TEMPLATE_FIELDS)
    if unknown:
        raise ValueError(f"scorer.judge.template uses {unknown}; allowed: {{prompt}}, {{response}}, {{reference}}")
    return template


class JudgeSettings(BaseModel):
    """An LLM judge behind an OpenAI-compatible chat-completions endpoint (stream_rl.rewards.judge)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(min_length=8, max_length=2000, pattern=r"^https?://",
                          description="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    model: str = Field(min_length=1, max_length=300, description="model name sent in every request")
    template: str = Field(min_length=1, max_length=100_000,
                          description="user message; may use {prompt}, {response}, {reference} ({{ }} for braces)")
    system: str | None = Field(None, max_length=100_000, description="system message; None: none")
    score_pattern: str = Field(DEFAULT_PATTERN, min_length=3, max_length=1000,
                               description="regex with one group: the last match's group is the score")
    parser: str | None = Field(None, max_length=300, description="'package.module:function' text -> float "
                                                                 "(ValueError on nonsense); replaces score_pattern")
    api_key_env: str | None = Field(None, max_length=200, description="environment variable holding the API key "
                                                                      "(sent as a Bearer token, never logged)")
    max_tokens: int = Field(256, ge=1, le=32_768, description="largest judge answer in tokens")
    temperature: float = Field(0.0, ge=0, le=2, description="judge sampling temperature")
    show_text: bool = Field(False, description="keep the judge's text in dead-letter reasons (default: redacted)")

    @field_validator("template")
    @classmethod
    def _template_fields(cls, value: str) -> str:
        return check_template(value)


class RewardTermConfig(Section):
    """One reward function of a route and its weight."""

    fn: str = Field(min_length=1, max_length=300,
                    description="a built-in verifier (gsm8k, math_boxed, multiple_choice) or 'package.module:function'")
    weight: float = Field(1.0, allow_inf_nan=False, ge=-1e6, le=1e6,
                          description="weight of this function's reward in the sum; non-zero")

    @field_validator("fn")
    @classmethod
    def _known_fn(cls, value: str) -> str:
        from stream_rl.rewards.routing import check_fn_name

        return check_fn_name(value)  # RewardFnError (a ValueError) names what is wrong

    @field_validator("weight")
    @classmethod
    def _non_zero(cls, value: float) -> float:
        if value == 0:
            raise ValueError("weight 0 adds nothing: remove the entry instead")
        return value


class RewardsConfig(Section):
    """Rewards routed by a metadata value (``routes[value]`` else ``default``), one shape for scorer and evaluator.

    ``scorer.rewards`` and ``eval.rewards`` are both this section. A value with neither a route nor a default is not
    scored: the scorer dead-letters the rollout, the evaluator counts the response as a reward error."""

    by: str = Field("data_source", min_length=1, max_length=128,
                    description="the prompt metadata key whose value picks the route (e.g. data_source)")
    routes: dict[str, Annotated[list[RewardTermConfig], Field(min_length=1)]] = Field(
        default_factory=dict, max_length=10_000,
        description="metadata value -> [{fn, weight}, ...]; each list non-empty, no function twice")
    default: list[RewardTermConfig] | None = Field(
        None, min_length=1, description="[{fn, weight}, ...] for a value with no route (or no such key); None: "
                                        "such a rollout is not scored (the scorer dead-letters it with the key "
                                        "and value)")

    @model_validator(mode="after")
    def _routes_are_usable(self) -> RewardsConfig:
        self.to_routes()  # ValueError naming the route: empty list, a function twice, nothing routed
        return self

    def to_routes(self, where: str = "scorer.rewards") -> RewardRoutes:
        """The core's :class:`stream_rl.rewards.routing.RewardRoutes` of this section (``where``: its setting's
        name, for the reasons)."""
        from stream_rl.rewards.routing import RewardRoutes, RewardTerm

        def terms(items: list[RewardTermConfig]) -> tuple[RewardTerm, ...]:
            return tuple(RewardTerm(t.fn, t.weight) for t in items)

        return RewardRoutes(by=self.by, routes={v: terms(items) for v, items in self.routes.items()},
                            default=None if self.default is None else terms(self.default), where=where)


def routes_replace_reward_fn(data: Any, section: str) -> Any:
    """A section's raw values (``scorer``, ``eval``) with ``reward_fn`` None when ``rewards`` (routes) is set:
    routes replace the single reward function; setting both is a ValueError naming ``<section>.rewards`` and
    ``<section>.reward_fn`` (the section's ``mode="before"`` validator calls this)."""
    if isinstance(data, dict) and data.get("rewards") is not None:
        if data.get("reward_fn") is not None:
            raise ValueError(f"set {section}.rewards or {section}.reward_fn, not both (routes replace the single "
                             f"reward function: route it as {section}.rewards.default = [{{fn = ..., weight = "
                             f"1.0}}])")
        data = {**data, "reward_fn": None}
    return data


__all__ = ["CALL_PREFIX", "DEFAULT_PATTERN", "TEMPLATE_FIELDS", "CallPolicy", "JudgeSettings", "RewardTermConfig",
           "RewardsConfig", "check_backoff", "check_template", "routes_replace_reward_fn"]
