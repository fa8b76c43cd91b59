"""The settings of reward calls and of the LLM judge, declared once (pydantic; nothing heavy is imported here).

Consumes: keyword values, from the core's callers directly (``CallPolicy(timeout_s=5.0)``) or from the scorer's
config section, which holds the same declarations (``consumers/scorer/config.py``: ``scorer.reward_*`` are
:class:`CallPolicy`'s fields under a ``reward_`` prefix, ``scorer.judge`` is a :class:`JudgeSettings`).
Produces: :class:`CallPolicy` (deadline, concurrency, retries and backoff of every reward call, frozen) and
:class:`JudgeSettings` (what :class:`stream_rl.rewards.judge.JudgeReward` sends and how it reads the answer).
Guarantees: each field's default, bounds and description exist here only; a value out of bounds, an unknown field,
a backoff cap below the first backoff or a judge template with fields other than {prompt}, {response}, {reference}
is a ValueError (pydantic's ``ValidationError``) naming the field when the object is built.
"""

from __future__ import annotations

import copy
import string
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

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


__all__ = ["CALL_PREFIX", "DEFAULT_PATTERN", "TEMPLATE_FIELDS", "CallPolicy", "JudgeSettings", "check_backoff",
           "check_template"]
