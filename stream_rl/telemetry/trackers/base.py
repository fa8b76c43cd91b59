"""The interface every tracker backend implements, and the pure helpers that shape what they are given.

Consumes: a trainer ``metrics.jsonl`` row, the resolved config as a JSON-ready dict (``model_dump(mode="json")``:
``SecretStr`` values are already ``"**********"``), scored rollouts for sample tables.
Produces: :class:`Tracker` (the interface), :class:`Opened` (what opening a tracker run found),
:func:`scalars` (the finite numbers of a row), :func:`hyperparams` (a flat ``{"a.b": "value"}`` map),
:func:`evaluation_metrics` (those of an evaluation's row),
:func:`sample_rows` (a table, content redacted unless asked) and :func:`first_step` (the exactly-once rule).
Guarantees: the helpers are pure; a sample text is shown only with ``show_content``, otherwise it becomes
``"<redacted: N chars>"`` (the format of ``stream-rl replay``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEP_KEY = "trainer/step"
"""Logged last with every metrics row: a tracker that can be queried reports the highest step it holds by it."""
NOT_METRICS = frozenset({"step", "time"})


@dataclass(frozen=True)
class Opened:
    """What opening a tracker run found: its id and the highest step its store holds (0: none; None: the backend
    cannot tell, the worker's record of what it logged counts)."""

    run_id: str
    held_step: int | None


class Tracker:
    """One backend. Every method is called from the tracker's own background thread, never from the trainer's.

    ``rewinds``: the backend can hide the steps at and after a given step (TensorBoard's purge), so a resumed run
    re-logs the steps after its checkpoint with their new values; the others keep the steps they hold."""

    name = "base"
    rewinds = False

    def __init__(self, directory: Path, project: str, run_name: str):
        self.directory, self.project, self.run_name = Path(directory), project, run_name

    def open(self, run_id: str | None, purge_from: int | None) -> Opened:
        """Start (``run_id`` None) or continue the tracker run; ``purge_from``: hide steps >= it (rewinds only)."""
        raise NotImplementedError

    def log_params(self, params: Mapping[str, str]) -> None:
        raise NotImplementedError

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """One step's scalars (``STEP_KEY`` last); durable when this returns (flushed)."""
        raise NotImplementedError

    def log_evaluation(self, step: int, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def retriable(self, exc: BaseException) -> bool:
        """Whether a call that raised ``exc`` may succeed when sent again (the worker drops it otherwise)."""
        return True

    def close(self) -> None:
        raise NotImplementedError


def first_step(rewinds: bool, held_step: int | None, logged_step: int, resume_step: int) -> int:
    """The first step this tracker is given after opening (every step before it is skipped).

    - ``rewinds``: ``min(logged_step, resume_step) + 1`` (everything at and after it is purged and logged again:
      the tracker ends up holding exactly the rows of ``metrics.jsonl``);
    - otherwise ``held_step + 1`` (``logged_step + 1`` when the tracker cannot tell): a step the tracker holds is
      never logged twice, and a step re-trained after the checkpoint keeps the values it was first logged with;
      steps the checkpoint covers that never reached it are logged from ``metrics.jsonl``.
    ``held_step``: what the tracker's store reports holding; ``logged_step``: what the worker's state file says
    it logged (one step ahead of the store at most: the file is written after the store accepted the step);
    ``resume_step``: the checkpoint's step (0 on a fresh start)."""
    if rewinds:
        return min(logged_step, resume_step) + 1
    return (logged_step if held_step is None else held_step) + 1


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row, ``step`` and ``time`` left out (bools count as 0/1; null is dropped)."""
    out = {}
    for key, value in row.items():
        if key in NOT_METRICS or value is None or isinstance(value, str):
            continue
        if isinstance(value, (int, float)) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


def evaluation_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The metrics of an evaluation's row (:func:`stream_rl.evaluation.ledger.row_of`): its ``eval/...`` keys, and
    its ``metrics`` map (the evaluator's ``{"<set>/<metric>": value}``) with ``eval/`` put in front:
    ``{"metrics": {"held/acc": 1}}`` -> ``{"eval/held/acc": 1.0}``; finite numbers only."""
    found = {k: v for k, v in row.items() if k.startswith("eval/")}
    nested = row.get("metrics")
    if isinstance(nested, Mapping):
        found.update({k if k.startswith("eval/") else f"eval/{k}": v for k, v in nested.items()})
    return scalars(found)


def hyperparams(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config dict flattened to ``{"trainer.lr": "1e-06", ...}`` (lists and empty maps as JSON, None as "")."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(hyperparams(value, name + "."))
        elif isinstance(value, (Mapping, list)):
            out[name] = json.dumps(value, sort_keys=True)
        else:
            out[name] = "" if value is None else str(value)
    return out


def redacted(text: str | None, show_content: bool) -> str:
    """``text`` itself with ``show_content``, else ``"<redacted: N chars>"``."""
    text = text or ""
    return text if show_content else f"<redacted: {len(text)} chars>"


def sample_rows(scored: Iterable[Any], limit: int, show_content: bool) -> list[dict[str, Any]]:
    """Up to ``limit`` rows ``{"rollout_id", "prompt", "response", "reward", "finish_reason"}`` of scored
    rollouts, texts redacted unless ``show_content``."""
    rows = []
    for s in scored:
        if len(rows) >= limit:
            break
        r = s.rollout
        rows.append({"rollout_id": r.rollout_id if show_content else f"#{len(rows)}",
                     "prompt": redacted(r.prompt_text, show_content),
                     "response": redacted(r.response_text, show_content),
                     "reward": float(s.reward), "finish_reason": r.finish_reason})
    return rows
