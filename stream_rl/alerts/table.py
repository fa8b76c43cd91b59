"""The alert rule table: every alert rule declared once, as one row.

Consumes: nothing (plain data; imports only the standard library, so ``stream_rl.config`` can load it).
Produces: :data:`RULES`, one :class:`RuleSpec` per rule, in evaluation order: its name, the condition in words, the
observation keys it reads, the evaluator that judges it (``kind``, see :mod:`stream_rl.alerts.rules`), its
threshold fields (default, bounds, description), the field reported as the alert's bound, the sample history it
needs (``window``), its default action, whether ``pause`` is allowed (and why not), the roles that evaluate it and
its checks across its own fields; :func:`rules_markdown`, the rule table of ``docs/alerts.md``.
Guarantees: the config sections ``alerts.<rule>.<field>`` (:mod:`stream_rl.alerts.config`), the engine's rules
(:func:`stream_rl.alerts.rules.build_rules`) and the documented table are all built from these rows; a new rule is
one row (plus an evaluator when no existing ``kind`` fits) and a test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Action = Literal["log", "pause", "stop"]


@dataclass(frozen=True)
class Threshold:
    """One numeric field of a rule's section: its type is that of ``default`` (int or float)."""

    name: str
    default: float
    description: str
    gt: float | None = None
    ge: float | None = None
    le: float | None = None

    @property
    def bounds(self) -> dict[str, float]:
        """The pydantic bounds that are set (``gt``, ``ge``, ``le``)."""
        return {k: v for k, v in (("gt", self.gt), ("ge", self.ge), ("le", self.le)) if v is not None}


def _latest(section: Any) -> tuple[float, int]:
    return 0.0, 1


@dataclass(frozen=True)
class RuleSpec:
    """One alert rule. ``window(section) -> (seconds, samples)``: each key it reads keeps the samples of the last
    ``seconds`` (plus the newest older one) and at least the latest ``samples``."""

    name: str
    kind: str  # the evaluator in stream_rl.alerts.rules.EVALUATORS
    reads: tuple[str, ...]  # observation keys
    holds: str  # the condition, in words (section docstring and docs/alerts.md)
    thresholds: tuple[Threshold, ...] = ()
    bound: str | None = None  # the threshold field reported as the alert's bound
    action: Action = "log"
    window: Callable[[Any], tuple[float, int]] = _latest
    pause_never_clears: str | None = None  # set: action = pause is refused, for this reason
    roles: tuple[str, ...] | None = None  # None: every role with data
    at_most: tuple[tuple[str, str], ...] = ()  # (a, b): the section requires a <= b


def _consecutive() -> Threshold:
    return Threshold("consecutive", 1, "how many consecutive steps must exceed it", ge=1, le=10_000)


RULES: tuple[RuleSpec, ...] = (
    RuleSpec("loss_nonfinite", "nonfinite", ("loss/total",), "the latest `loss/total` is NaN or +-Inf",
             action="stop"),
    RuleSpec("grad_norm_nonfinite", "nonfinite", ("optim/grad_norm",),
             "the latest `optim/grad_norm` is NaN or +-Inf", action="stop"),
    RuleSpec("kl_ref_high", "above", ("kl/ref_mean",), "`kl/ref_mean` > `max_kl` on the last `consecutive` steps",
             (Threshold("max_kl", 1.0, "bound on the mean per-token KL to the reference (nats); the demo peaks "
                        "near 0.75", gt=0), _consecutive()),
             bound="max_kl", window=lambda c: (0.0, c.consecutive)),
    RuleSpec("reward_drop", "reward_drop", ("reward/mean",),
             "the mean of `reward/mean` over the last `window_steps` steps is more than `max_drop` below the best "
             "earlier window mean",
             (Threshold("max_drop", 0.2, "allowed fall of the windowed mean reward (reward units) below the best "
                        "earlier window", gt=0),
              Threshold("window_steps", 20, "steps per window (W)", ge=1, le=100_000),
              Threshold("lookback_windows", 10, "earlier windows searched for the best mean (the history kept is "
                        "W * (lookback_windows + 1) steps)", ge=1, le=1000)),
             bound="max_drop", window=lambda c: (0.0, c.window_steps * (c.lookback_windows + 1))),
    RuleSpec("consumer_lag", "lag", ("lag/position_total",),
             "records not yet read (`lag/position_total`) > `max_records` continuously for >= `for_s` seconds "
             "(producers: and growing)",
             (Threshold("max_records", 1000, "lag bound in records not yet read (N); producers: and growing", ge=0),
              Threshold("for_s", 60.0, "how long the lag must stay above it (T, seconds)", gt=0, le=86_400)),
             bound="max_records", window=lambda c: (c.for_s, 2),
             pause_never_clears="a paused consumer keeps its partitions, so their lag only grows"),
    RuleSpec("trainer_stalled", "stalled", ("step",), "the trainer's `step` has not increased for >= `stall_s` "
             "seconds",
             (Threshold("stall_s", 600.0, "seconds without a new optimizer step (T)", gt=0, le=604_800),),
             bound="stall_s", window=lambda c: (c.stall_s, 1), roles=("trainer",),
             pause_never_clears="a paused trainer makes no step"),
    RuleSpec("memory_growth", "growth", ("process/rss_bytes", "gpu/allocated_bytes"),
             "`process/rss_bytes` or `gpu/allocated_bytes` grows steadily over the last `window_s`: least-squares "
             "slope > `max_slope_bytes_per_s` and >= `min_increase_fraction` of the steps increasing",
             (Threshold("window_s", 600.0, "samples of the last window_s seconds are fitted", gt=0, le=86_400),
              Threshold("min_span_s", 300.0, "the samples must span at least this long (keeps start-up loading "
                        "from looking like a leak)", gt=0, le=86_400),
              Threshold("min_samples", 10, "fewest samples in the window (K)", ge=3, le=100_000),
              Threshold("max_slope_bytes_per_s", 1_048_576.0, "growth bound (bytes per second, 1 MiB/s = "
                        "3.5 GiB/hour)", gt=0),
              Threshold("min_increase_fraction", 0.8, "'monotone-ish': the fraction of consecutive differences "
                        "that must be > 0", gt=0, le=1)),
             bound="max_slope_bytes_per_s", window=lambda c: (c.window_s, 1), at_most=(("min_span_s", "window_s"),)),
    RuleSpec("logprob_mismatch", "above", ("mismatch/logp_abs_diff",),
             "`mismatch/logp_abs_diff` (mean absolute sampler - trainer token logprob) > `max_abs_diff` on the last "
             "`consecutive` steps",
             (Threshold("max_abs_diff", 0.2, "bound on the mean absolute logprob difference (nats)", gt=0),
              _consecutive()),
             bound="max_abs_diff", window=lambda c: (0.0, c.consecutive)),
    RuleSpec("dlq_rate", "rate", ("dlq/total",),
             "dead letters this process sent (`dlq/total`) over the last `window_s` seconds, per minute, > "
             "`max_per_minute`",
             (Threshold("max_per_minute", 10.0, "dead-letter rate bound (records per minute)", ge=0),
              Threshold("window_s", 60.0, "window the rate is measured over (seconds)", gt=0, le=86_400)),
             bound="max_per_minute", window=lambda c: (c.window_s, 2)),
)


def rules_markdown() -> str:
    """The rule table of ``docs/alerts.md`` (a test checks the document holds it)."""
    lines = ["| rule | reads | holds when | thresholds (defaults) | default action | `pause` allowed |",
             "|---|---|---|---|---|---|"]
    for r in RULES:
        reads = ", ".join(f"`{k}`" for k in r.reads) + (f" ({', '.join(r.roles)} only)" if r.roles else "")
        bounds = ", ".join(f"`{t.name}` = {t.default}" for t in r.thresholds) or "-"
        pause = f"no: {r.pause_never_clears}" if r.pause_never_clears else "yes"
        lines.append(f"| `{r.name}` | {reads} | {r.holds} | {bounds} | `{r.action}` | {pause} |")
    return "\n".join(lines) + "\n"
