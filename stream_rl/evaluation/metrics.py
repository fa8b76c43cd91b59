"""Held-out evaluation metrics: pure functions from per-prompt outcomes to a flat ``{name: float}`` map.

Consumes: one :class:`PromptOutcome` per evaluated prompt (the rewards, extracted answers, lengths and finish
reasons of its ``n`` sampled responses, and the reward of its greedy response when greedy decoding ran).
Produces: ``{"<set>/<metric>": value}`` and ``{"<set>/<source>/<metric>": value}`` (per data source) with
``mean@n``, ``pass@k`` for every asked ``k``, ``maj@k`` where answers were extracted, ``greedy/accuracy``,
``greedy/reward``, ``length/mean``, ``finish/<reason>`` (fractions) and ``prompts`` (a count).
Guarantees:
- ``pass@k`` is the unbiased estimator of Chen et al. 2021, ``1 - C(n-c, k) / C(n, k)``, computed as the product
  ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (no huge binomials); ``k > n`` raises :class:`ValueError` naming
  ``eval.k`` (the config refuses it first).
- A response counts as correct when its reward is ``>= correct_at``; nothing here calls a model or a reward.
- Every value is finite; a metric with no data (``maj@k`` when no answer was extracted, ``greedy/*`` without a
  greedy response) is left out rather than reported as 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class PromptOutcome:
    """What one prompt's evaluation produced: ``n`` sampled responses (lists of equal length ``n``) and an
    optional greedy response."""

    source: str
    rewards: Sequence[float]
    lengths: Sequence[int]
    finish_reasons: Sequence[str]
    answers: Sequence[str | None] = field(default_factory=tuple)
    greedy_reward: float | None = None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct of ``n`` samples (Chen et al. 2021, eq. 1):

    ``1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i)``; 1.0 when ``n - c < k``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"eval.k: pass@{k} needs 1 <= k <= n = {n}")
    if not 0 <= c <= n:
        raise ValueError(f"correct count {c} outside [0, {n}]")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def majority_correct(answers: Sequence[str | None], rewards: Sequence[float], k: int,
                     correct_at: float) -> float | None:
    """maj@k of one prompt: among the first ``k`` samples, the most frequent extracted answer (ties: the one seen
    first) is correct when the first sample giving it has reward ``>= correct_at``. None: no answer extracted."""
    votes = [(a, r) for a, r in zip(answers[:k], rewards[:k]) if a is not None]
    if not votes:
        return None
    counts = Counter(a for a, _ in votes)
    best = max(counts.values())
    winner = next(a for a, _ in votes if counts[a] == best)
    reward = next(r for a, r in votes if a == winner)
    return 1.0 if reward >= correct_at else 0.0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def group_metrics(outcomes: Sequence[PromptOutcome], ks: Sequence[int], correct_at: float) -> dict[str, float]:
    """The metrics of one group of prompts (a set, or one data source of it); ``outcomes`` non-empty.

    ``mean@n`` = mean over prompts of the mean sampled reward; ``pass@k``, ``maj@k`` = means over prompts;
    ``greedy/accuracy`` = fraction of greedy responses with reward ``>= correct_at``; ``length/mean`` = mean
    response tokens over all samples; ``finish/<reason>`` = fraction of samples that ended so."""
    n = len(outcomes[0].rewards)
    for o in outcomes:
        if len(o.rewards) != n or len(o.lengths) != n or len(o.finish_reasons) != n:
            raise ValueError(f"every prompt needs n = {n} rewards, lengths and finish reasons")
    out = {"prompts": float(len(outcomes)), f"mean@{n}": _mean([_mean(o.rewards) for o in outcomes])}
    for k in ks:
        out[f"pass@{k}"] = _mean([pass_at_k(n, sum(r >= correct_at for r in o.rewards), k) for o in outcomes])
        votes = [majority_correct(o.answers, o.rewards, k, correct_at) for o in outcomes if o.answers]
        votes = [v for v in votes if v is not None]
        if votes:
            out[f"maj@{k}"] = _mean(votes)
    greedy = [o.greedy_reward for o in outcomes if o.greedy_reward is not None]
    if greedy:
        out["greedy/accuracy"] = _mean([1.0 if r >= correct_at else 0.0 for r in greedy])
        out["greedy/reward"] = _mean(greedy)
    lengths = [x for o in outcomes for x in o.lengths]
    out["length/mean"] = _mean(lengths)
    reasons = Counter(x for o in outcomes for x in o.finish_reasons)
    out.update({f"finish/{reason}": count / len(lengths) for reason, count in sorted(reasons.items())})
    return out


def set_metrics(name: str, outcomes: Sequence[PromptOutcome], ks: Sequence[int],
                correct_at: float) -> dict[str, float]:
    """``<name>/<metric>`` over the whole set, plus ``<name>/<source>/<metric>`` per data source when the set
    holds more than one source."""
    if not outcomes:
        raise ValueError(f"eval.sets.{name}: no prompts to evaluate")
    out = {f"{name}/{key}": value for key, value in group_metrics(outcomes, ks, correct_at).items()}
    sources = sorted({o.source for o in outcomes})
    if len(sources) > 1:
        for source in sources:
            part = [o for o in outcomes if o.source == source]
            out.update({f"{name}/{source}/{key}": v for key, v in group_metrics(part, ks, correct_at).items()})
    return out
