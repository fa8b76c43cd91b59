"""Which policy version the evaluator takes next: a pure function of what it has seen and what is done.

Consumes: the versions whose manifests the evaluator has seen, the versions already evaluated (read back from the
evals topic), ``eval.every_versions`` and ``eval.before_train``.
Produces: a :class:`Plan`: the version to evaluate now (or None) and the due versions it passes over.

Rule::

    due      = {v seen : v % every == 0}  (+ {0} when before_train)
    pending  = {v in due : v > newest done}     (older holes were skipped earlier, and said so)
    target   = 0 if 0 is pending (the "before" of a run), else max(pending)
    skipped  = pending - {target} - {0}   below target (newer ones stay pending)

Guarantees: a done version is never a target (no evaluation twice, also after a restart, because ``done`` is read
from the topic); the target is the newest due version, so an evaluator slower than the trainer lags by at most one
evaluation and skips the versions in between, which it reports.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Plan:
    """``target``: version to evaluate now (None: nothing due); ``skipped``: due versions passed over, ascending."""

    target: int | None
    skipped: list[int] = field(default_factory=list)


def plan_next(seen: Collection[int], done: Collection[int], every: int, before_train: bool) -> Plan:
    """The next version to evaluate (see the module rule); ``every >= 1``."""
    if every < 1:
        raise ValueError(f"eval.every_versions must be >= 1, got {every}")
    due = {v for v in seen if v % every == 0 and v > 0}
    if before_train:
        due.add(0)
    newest_done = max(done, default=-1)
    pending = sorted(v for v in due if v > newest_done and v not in done)
    if not pending:
        return Plan(None)
    target = 0 if pending[0] == 0 else pending[-1]
    return Plan(target, [v for v in pending if 0 < v < target])
