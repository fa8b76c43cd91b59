"""Configuration of the alert rules (``cfg.alerts``).

Consumes: nothing (a pydantic section, validated when the root config is loaded).
Produces: :class:`AlertsConfig`, read by every role process's alert engine (:mod:`stream_rl.alerts.engine`).
Guarantees: every threshold has bounds and a default; each rule has its own ``enabled`` flag and ``action``
(``log``: a record and a log line only; ``pause``: the process stops consuming until the alert resolves;
``stop``: the process exits non-zero, code 3, after a final checkpoint). ``pause`` is refused for the two rules
a pause cannot clear (``consumer_lag``, ``trainer_stalled``). The formulas are in
:mod:`stream_rl.alerts.rules` and ``docs/alerts.md``.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from stream_rl.config.base import Section

Action = Literal["log", "pause", "stop"]

_ENABLED = "evaluate this rule"
_ACTION = "what a firing alert does besides its record and log line: log | pause (stop consuming until it " \
          "resolves) | stop (exit code 3 after a final checkpoint)"


class _PauseNeverClears(Section):
    """A rule whose condition a paused consumer can only make worse: its ``action`` must not be ``pause``, which
    would never resolve. Subclasses name the rule and say why."""

    rule: ClassVar[str]
    pause_never_clears: ClassVar[str]

    @model_validator(mode="after")
    def _no_pause(self) -> _PauseNeverClears:
        if self.action == "pause":
            raise ValueError(f"alerts.{self.rule}.action = pause would never resolve ({self.pause_never_clears}); "
                             f"use log or stop")
        return self


class LossNonFiniteRule(Section):
    """``loss_nonfinite``: the trainer's latest ``loss/total`` is NaN or +-Inf."""

    enabled: bool = Field(True, description=_ENABLED)
    action: Action = Field("stop", description=_ACTION)


class GradNormNonFiniteRule(Section):
    """``grad_norm_nonfinite``: the trainer's latest ``optim/grad_norm`` is NaN or +-Inf."""

    enabled: bool = Field(True, description=_ENABLED)
    action: Action = Field("stop", description=_ACTION)


class KlRefHighRule(Section):
    """``kl_ref_high``: ``kl/ref_mean`` > ``max_kl`` on the last ``consecutive`` steps."""

    enabled: bool = Field(True, description=_ENABLED)
    action: Action = Field("log", description=_ACTION)
    max_kl: float = Field(1.0, gt=0, description="bound on the mean per-token KL to the reference (nats); the "
                          "demo peaks near 0.75")
    consecutive: int = Field(1, ge=1, le=10_000, description="how many consecutive steps must exceed it")


class RewardDropRule(Section):
    """``reward_drop``: the mean of ``reward/mean`` over the last ``window_steps`` steps is more than ``max_drop``
    below the best such window mean in the retained history."""

    enabled: bool = Field(True, description=_ENABLED)
    action: Action = Field("log", description=_ACTION)
    max_drop: float = Field(0.2, gt=0, description="allowed fall of the windowed mean reward (reward units) "
                            "below the best earlier window")
    window_steps: int = Field(20, ge=1, le=100_000, description="steps per window (W)")
    lookback_windows: int = Field(10, ge=1, le=1000, description="earlier windows searched for the best mean "
                                  "(the history kept is W * (lookback_windows + 1) steps)")


class ConsumerLagRule(_PauseNeverClears):
    """``consumer_lag``: ``lag/position_total`` (records this process has not read yet, over its partitions:
    high-water mark - its position, not its committed offset, which the trainer moves only at checkpoints) >
    ``max_records`` continuously for at least ``for_s`` seconds. Producers read prompts loaded ahead of time, so
    for them the lag must also be growing over those ``for_s`` seconds."""

    rule = "consumer_lag"
    pause_never_clears = "a paused consumer keeps its partitions, so their lag only grows"

    enabled: bool = Field(True, description=_ENABLED)
    action: Action = Field("log", description=_ACTION)
    max_records: int = Field(1000, ge=0, description="lag bound in records not yet read (N); producers: and "
                             "growing")
    for_s: float = Field(60.0, gt=0, le=86_400, description="how long the lag must stay above it (T, seconds)")


class TrainerStalledRule(_PauseNeverClears):
    """``trainer_stalled``: the trainer's ``step`` has not increased for at least ``stall_s`` seconds."""

    rule = "trainer_stalled"
    pause_never_clears = "a paused trainer makes no step"

    enabled: bool = Field(True, description=_ENABLED)
    action: Action = Field("log", description=_ACTION)
    stall_s: float = Field(600.0, gt=0, le=604_800, description="seconds without a new optimizer step (T)")


class MemoryGrowthRule(Section):
    """``memory_growth``: ``process/rss_bytes`` or ``gpu/allocated_bytes`` grows steadily over the window:
    least-squares slope > ``max_slope_bytes_per_s`` and at least ``min_increase_fraction`` of the consecutive
    differences are increases, over >= ``min_samples`` samples spanning >= ``min_span_s`` seconds."""

    enabled: bool = Field(True, description=_ENABLED)
    action: Action = Field("log", description=_ACTION)
    window_s: float = Field(600.0, gt=0, le=86_400, description="samples of the last window_s seconds are fitted")
    min_span_s: float = Field(300.0, gt=0, le=86_400, description="the samples must span at least this long "
                              "(keeps start-up loading from looking like a leak)")
    min_samples: int = Field(10, ge=3, le=100_000, description="fewest samples in the window (K)")
    max_slope_bytes_per_s: float = Field(1_048_576.0, gt=0, description="growth bound (bytes per second, "
                                         "1 MiB/s = 3.5 GiB/hour)")
    min_increase_fraction: float = Field(0.8, gt=0, le=1, description="'monotone-ish': the fraction of "
                                         "consecutive differences that must be > 0")

    @model_validator(mode="after")
    def _span_fits_window(self) -> MemoryGrowthRule:
        if self.min_span_s > self.window_s:
            raise ValueError(f"alerts.memory_growth.min_span_s ({self.min_span_s}) must be <= window_s "
                             f"({self.window_s})")
        return self


class LogprobMismatchRule(Section):
    """``logprob_mismatch``: ``mismatch/logp_abs_diff`` (mean |sampler - trainer| token logprob) > ``max_abs_diff``
    on the last ``consecutive`` steps."""

    enabled: bool = Field(True, description=_ENABLED)
    action: Action = Field("log", description=_ACTION)
    max_abs_diff: float = Field(0.2, gt=0, description="bound on the mean absolute logprob difference (nats)")
    consecutive: int = Field(1, ge=1, le=10_000, description="how many consecutive steps must exceed it")


class DlqRateRule(Section):
    """``dlq_rate``: dead letters this process sent (``dlq/total``) over the last ``window_s`` seconds, per
    minute, > ``max_per_minute``."""

    enabled: bool = Field(True, description=_ENABLED)
    action: Action = Field("log", description=_ACTION)
    max_per_minute: float = Field(10.0, ge=0, description="dead-letter rate bound (records per minute)")
    window_s: float = Field(60.0, gt=0, le=86_400, description="window the rate is measured over (seconds)")


class AlertsConfig(Section):
    """Alert thresholds and per-alert actions (log | pause | stop)."""

    enabled: bool = Field(True, description="evaluate the alert rules at all")
    loss_nonfinite: LossNonFiniteRule = Field(default_factory=LossNonFiniteRule)
    grad_norm_nonfinite: GradNormNonFiniteRule = Field(default_factory=GradNormNonFiniteRule)
    kl_ref_high: KlRefHighRule = Field(default_factory=KlRefHighRule)
    reward_drop: RewardDropRule = Field(default_factory=RewardDropRule)
    consumer_lag: ConsumerLagRule = Field(default_factory=ConsumerLagRule)
    trainer_stalled: TrainerStalledRule = Field(default_factory=TrainerStalledRule)
    memory_growth: MemoryGrowthRule = Field(default_factory=MemoryGrowthRule)
    logprob_mismatch: LogprobMismatchRule = Field(default_factory=LogprobMismatchRule)
    dlq_rate: DlqRateRule = Field(default_factory=DlqRateRule)
