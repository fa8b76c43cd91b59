"""The alert rules: pure functions over windows of ``(time, value)`` samples, and one rule object per alert.

Consumes: samples of the observation keys (``loss/total``, ``optim/grad_norm``, ``kl/ref_mean``, ``reward/mean``,
``mismatch/logp_abs_diff``, ``step``, ``lag/position_total``, ``process/rss_bytes``, ``gpu/allocated_bytes``,
``dlq/total``), oldest first; each rule's row of the rule table (:mod:`stream_rl.alerts.table`: keys, bound,
history, roles) and its config section (:mod:`stream_rl.alerts.config`).
Produces: a :class:`Verdict` (holds or not, the value seen, the bound, a message made of numbers and key names
only, never sample text), or ``None`` when there is no data to judge: a rule never fires on missing data.
Guarantees: every comparison with a bound is strict (a value equal to the bound does not fire); the formulas::

    nonfinite        holds  <=>  latest value is NaN or +-Inf
    above bound      holds  <=>  the last c values (c = consecutive) are all > bound        (needs >= c samples)
    reward_drop      m(i)   =  mean of the W values ending at i;  current = m(last)
                     best   =  max m(j) over windows that end before the current window begins
                     holds  <=>  best - current > max_drop                                   (needs >= 2W samples)
    consumer_lag     lag    =  lag/position_total: records not yet read (high-water mark - the process's position;
                               not its committed offset, which the trainer moves only at checkpoints)
                     t0     =  time of the oldest sample of the trailing run with lag > N
                     holds  <=>  t0 exists and t0 <= now - T
                     producers (prompts are loaded ahead: a backlog is normal, only growth is actionable):
                     a      =  the newest sample with t <= now - T;  W = the samples from a to the latest
                     holds  <=>  the above  and  v_last > v_a  and  #{i in W : v_i > v_(i-1)} / (|W| - 1) >= 1/2
    trainer_stalled  t0     =  time of the oldest sample s0 such that no later sample has step > step(s0)
                     holds  <=>  t0 <= now - T   (a trailing stretch of >= T seconds without a new step)
    memory_growth    on the samples with t >= now - window_s (n >= K, t_last - t_first >= min_span_s):
                     slope  =  sum((t - t_mean)(v - v_mean)) / sum((t - t_mean)^2)    (least squares, bytes/s)
                     inc    =  #{i : v_i > v_(i-1)} / (n - 1)
                     holds  <=>  slope > max_slope  and  inc >= min_increase_fraction
    dlq_rate         base   =  the newest sample with t <= now - window_s (else the oldest sample)
                     rate   =  max(0, v_last - v_base) / window_s * 60                     (records per minute)
                     holds  <=>  rate > max_per_minute                                        (needs >= 2 samples)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stream_rl.alerts.config import AlertsConfig
from stream_rl.alerts.table import RULES, RuleSpec

Sample = tuple[float, float]
"""``(time in seconds, value)``."""


@dataclass(frozen=True)
class Verdict:
    """A rule's judgement of its window: whether it holds, the value it judged, the bound, a message."""

    holds: bool
    value: float | None
    threshold: float | None
    message: str


# ---------------------------------------------------------------------------------------------- pure formulas


def least_squares_slope(samples: Sequence[Sample]) -> float:
    """Slope of the least-squares line through ``(t, v)``: ``sum((t-tm)(v-vm)) / sum((t-tm)^2)``; 0.0 when all
    times are equal or there are fewer than two samples."""
    n = len(samples)
    if n < 2:
        return 0.0
    t_mean = sum(t for t, _ in samples) / n
    v_mean = sum(v for _, v in samples) / n
    var = sum((t - t_mean) ** 2 for t, _ in samples)
    if var == 0.0:
        return 0.0
    return sum((t - t_mean) * (v - v_mean) for t, v in samples) / var


def increase_fraction(values: Sequence[float]) -> float:
    """Fraction of consecutive differences that are strictly positive (0.0 with fewer than two values)."""
    if len(values) < 2:
        return 0.0
    return sum(b > a for a, b in zip(values, values[1:])) / (len(values) - 1)


def window_means(values: Sequence[float], window: int) -> list[float]:
    """Means of every run of ``window`` consecutive values (rolling), oldest first."""
    if len(values) < window:
        return []
    total = sum(values[:window])
    means = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        means.append(total / window)
    return means


def above_since(samples: Sequence[Sample], bound: float) -> float | None:
    """Time of the oldest sample of the trailing run of values > ``bound`` (None when the latest is not)."""
    since = None
    for t, v in reversed(samples):
        if not v > bound:
            break
        since = t
    return since


def no_increase_since(samples: Sequence[Sample]) -> float | None:
    """Time of the oldest sample that no later sample exceeds, going back from the latest without a gap:
    the start of the trailing stretch with no increase (None without samples)."""
    since, later_max = None, -math.inf
    for t, v in reversed(samples):
        if v < later_max:
            break
        since, later_max = t, max(later_max, v)
    return since


def dlq_rate_per_minute(samples: Sequence[Sample], now: float, window_s: float) -> float:
    """Dead letters added over the last ``window_s`` seconds, per minute (a counter reset counts as 0)."""
    older = [s for s in samples if s[0] <= now - window_s]
    base = older[-1] if older else samples[0]
    return max(0.0, samples[-1][1] - base[1]) / window_s * 60.0


def _fmt(value: float) -> str:
    return f"{value:.6g}"


# ---------------------------------------------------------------------------------------------- rule objects


class Rule:
    """One alert rule: its row of the rule table (:mod:`stream_rl.alerts.table`), its config section, and the
    history the engine keeps for it (``horizon_s``: samples this recent plus the newest older one; ``keep``: at
    least this many of the latest)."""

    def __init__(self, spec: RuleSpec, section, role: str) -> None:
        self.spec, self.cfg, self.role = spec, section, role
        self.name, self.keys, self.roles = spec.name, spec.reads, spec.roles
        self.action: str = section.action
        self.horizon_s, self.keep = spec.window(section)
        self.bound = getattr(section, spec.bound) if spec.bound else None

    def evaluate(self, series: Mapping[str, Sequence[Sample]], now: float) -> Verdict | None:
        raise NotImplementedError


class NonFinite(Rule):
    def evaluate(self, series, now):
        samples = series.get(self.keys[0])
        if not samples:
            return None
        value = samples[-1][1]
        bad = not math.isfinite(value)
        return Verdict(bad, value, None, f"{self.keys[0]} is {_fmt(value)}" + (" (not finite)" if bad else ""))


class AboveBound(Rule):
    def evaluate(self, series, now):
        samples = series.get(self.keys[0], ())
        c = self.cfg.consecutive
        if len(samples) < c:
            return None
        last = [v for _, v in samples[-c:]]
        holds = all(v > self.bound for v in last)  # NaN compares False: the nonfinite rules cover it
        steps = f" on the last {c} steps" if c > 1 else ""
        return Verdict(holds, last[-1], self.bound,
                       f"{self.keys[0]} = {_fmt(last[-1])} {'>' if holds else '<='} {_fmt(self.bound)}{steps}")


class RewardDrop(Rule):
    def evaluate(self, series, now):
        w = self.cfg.window_steps
        values = [v for _, v in series.get("reward/mean", ()) if math.isfinite(v)]
        if len(values) < 2 * w:
            return None
        means = window_means(values, w)
        current, best = means[-1], max(means[: len(means) - w])  # earlier windows end before the current starts
        drop = best - current
        return Verdict(drop > self.bound, drop, self.bound,
                       f"reward/mean over the last {w} steps = {_fmt(current)}, best earlier window "
                       f"{_fmt(best)}: drop {_fmt(drop)} vs max_drop {_fmt(self.bound)}")


class ConsumerLag(Rule):
    """Producers read prompts loaded ahead: for them the lag must also be growing."""

    def evaluate(self, series, now):
        samples = series.get(self.keys[0])
        if not samples:
            return None
        n, lag, for_s = self.bound, samples[-1][1], self.cfg.for_s
        since = above_since(samples, n)
        holds = since is not None and since <= now - for_s
        text = f"for {_fmt(now - since)} s" if holds else f"(needs > {n} for {_fmt(for_s)} s)"
        if self.role == "producer":
            grew, growing = lag_growth(samples, now, for_s)
            holds = holds and grew > 0 and growing >= GROWING_FRACTION
            text += f", {grew:+g} records over the last {_fmt(for_s)} s ({growing:.0%} of measurements rising)"
        return Verdict(holds, lag, float(n), f"{self.keys[0]} = {_fmt(lag)} records {text}")


GROWING_FRACTION = 0.5
"""A producer's prompt lag counts as growing when at least this fraction of its measurements rose."""


def lag_growth(samples: Sequence[Sample], now: float, window_s: float) -> tuple[float, float]:
    """(v_last - v_a, fraction of rising steps from a to the latest), a = the newest sample with
    t <= now - window_s (else the oldest)."""
    older = [i for i, (t, _) in enumerate(samples) if t <= now - window_s]
    window = [v for _, v in samples[older[-1] if older else 0:]]
    return window[-1] - window[0], increase_fraction(window)


class TrainerStalled(Rule):
    def evaluate(self, series, now):
        samples = series.get("step")
        if not samples:
            return None
        since = no_increase_since(samples)
        holds = since is not None and since <= now - self.cfg.stall_s
        text = f"no new step for {_fmt(now - since)} s" if holds else "steps advancing"
        return Verdict(holds, samples[-1][1], self.cfg.stall_s,
                       f"step = {_fmt(samples[-1][1])}: {text} (stall_s {_fmt(self.cfg.stall_s)})")


class MemoryGrowth(Rule):
    def _judge(self, key: str, samples: Sequence[Sample], now: float) -> Verdict | None:
        c = self.cfg
        window = [s for s in samples if s[0] >= now - c.window_s and math.isfinite(s[1])]
        if len(window) < c.min_samples or window[-1][0] - window[0][0] < c.min_span_s:
            return None
        slope = least_squares_slope(window)
        inc = increase_fraction([v for _, v in window])
        holds = slope > c.max_slope_bytes_per_s and inc >= c.min_increase_fraction
        return Verdict(holds, slope, c.max_slope_bytes_per_s,
                       f"{key} slope {_fmt(slope)} B/s over {len(window)} samples "
                       f"({_fmt(window[-1][0] - window[0][0])} s), {inc:.0%} increasing; bound "
                       f"{_fmt(c.max_slope_bytes_per_s)} B/s and {c.min_increase_fraction:.0%}")

    def evaluate(self, series, now):
        verdicts = [v for key in self.keys if (v := self._judge(key, series.get(key, ()), now)) is not None]
        if not verdicts:
            return None
        holding = [v for v in verdicts if v.holds]
        return holding[0] if holding else verdicts[0]


class DlqRate(Rule):
    def evaluate(self, series, now):
        samples = series.get("dlq/total", ())
        if len(samples) < 2:
            return None
        rate = dlq_rate_per_minute(samples, now, self.cfg.window_s)
        bound = self.bound
        return Verdict(rate > bound, rate, bound,
                       f"dead letters {_fmt(rate)}/min over {_fmt(self.cfg.window_s)} s "
                       f"({'>' if rate > bound else '<='} {_fmt(bound)}/min)")


EVALUATORS: dict[str, type[Rule]] = {
    "nonfinite": NonFinite, "above": AboveBound, "reward_drop": RewardDrop, "lag": ConsumerLag,
    "stalled": TrainerStalled, "growth": MemoryGrowth, "rate": DlqRate,
}
"""The evaluator of each ``kind`` of the rule table."""


def build_rules(cfg: AlertsConfig, role: str) -> list[Rule]:
    """The enabled rules of the rule table that apply to ``role``, in table order (none when alerts are
    disabled)."""
    if not cfg.enabled:
        return []
    sections = [(spec, getattr(cfg, spec.name)) for spec in RULES]
    return [EVALUATORS[spec.kind](spec, section, role) for spec, section in sections
            if section.enabled and (spec.roles is None or role in spec.roles)]
