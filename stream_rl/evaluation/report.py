"""One line on held-out accuracy for the end of ``stream-rl run``: the first evaluation against the last.

Consumes: the rows of ``RUN_DIR/evals.jsonl`` (:func:`stream_rl.evaluation.ledger.read_rows`).
Produces: ``"held-out accuracy before -> after: 0.120 (v0) -> 0.480 (v40, step 40) [heldout/greedy/accuracy]"``.
Guarantees: pure; the metric is the first of ``<set>/greedy/accuracy``, ``<set>/pass@1``, ``<set>/mean@<n>`` that
the first row holds (sets in row order); rows without it are ignored; fewer than one row: a line saying so.
"""

from __future__ import annotations

from collections.abc import Sequence

PREFERRED = ("greedy/accuracy", "pass@1")


def headline_metric(row: dict) -> str | None:
    """The metric the line reports for a row: greedy accuracy, else pass@1, else mean@n, of its first set."""
    metrics, sets = row.get("metrics", {}), row.get("sets", [])
    for name in sets:
        for tail in PREFERRED:
            if f"{name}/{tail}" in metrics:
                return f"{name}/{tail}"
        means = sorted(k for k in metrics if k.startswith(f"{name}/mean@"))
        if means:
            return means[0]
    return None


def before_after_line(rows: Sequence[dict]) -> str:
    """``held-out accuracy before -> after`` over the rows, ordered by version."""
    rows = sorted((r for r in rows if isinstance(r.get("version"), int)), key=lambda r: r["version"])
    metric = headline_metric(rows[0]) if rows else None
    if metric is None:
        return "held-out accuracy: no evaluation recorded (see eval.every_versions and logs/evaluate-0.log)"
    rows = [r for r in rows if metric in r.get("metrics", {})]
    first, last = rows[0], rows[-1]
    return (f"held-out accuracy before -> after: {first['metrics'][metric]:.3f} (v{first['version']}) -> "
            f"{last['metrics'][metric]:.3f} (v{last['version']}, step {last.get('step', '?')}) [{metric}]")


def last_evaluation(rows: Sequence[dict]) -> dict | None:
    """The newest evaluation (highest version) as ``{"version", "step", "metrics"}`` with only the
    ``<set>/<metric>`` values (per-source values left out); None without rows."""
    rows = [r for r in rows if isinstance(r.get("version"), int)]
    if not rows:
        return None
    last = max(rows, key=lambda r: r["version"])
    metrics = {k: v for k, v in last.get("metrics", {}).items() if k.count("/") == 1 or "/greedy/" in k
               or "/finish/" in k or "/length/" in k}
    return {"version": last["version"], "step": last.get("step"), "metrics": metrics}


def with_evaluations(rows: Sequence[dict], evaluations: Sequence[dict]) -> list[dict]:
    """The trainer's metric rows with each evaluation's metrics added as ``eval/<name>`` at the step of the version
    it evaluated (a row of its own, ``{"step": s, ...}``, where the trainer logged no step ``s``, e.g. step 0 for
    version 0); sorted by step. For plots: the evaluation curves beside the training reward."""
    by_step = {r["step"]: dict(r) for r in rows if isinstance(r.get("step"), int)}
    others = [r for r in rows if not isinstance(r.get("step"), int)]
    for ev in evaluations:
        step = ev.get("step")
        if not isinstance(step, int):
            continue
        target = by_step.setdefault(step, {"step": step})
        target.update({f"eval/{k}": v for k, v in ev.get("metrics", {}).items()})
    return [by_step[s] for s in sorted(by_step)] + others
