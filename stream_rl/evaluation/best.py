"""Keep the best policy version by one evaluation metric beside the latest checkpoint (``trainer.keep_best``).

Consumes: the rows of the evaluations the evaluator publishes on the run's evals topic (``version``, ``step``,
``metrics``; handed over by a feed, :class:`stream_rl.evaluation.feed.EvalsFeed`, never read from a file), the
metric to judge by (``trainer.keep_best = "eval/<set>/<metric>"``, ``trainer.keep_best_mode``), which versions the
evaluator evaluates (``eval.every_versions``, ``eval.before_train``) and, from the trainer, a writer of the
weights of the version it just published.
Produces, under the trainer's checkpoint directory (``trainer.checkpoint_dir``, default ``RUN_DIR/checkpoints``)::

    eval-pending/v{N:08d}/   a candidate: the weights of version N (written by the trainer's writer:
                             model.safetensors as in a step-* checkpoint, lora.json with LoRA) + candidate.json
    best/                    the best candidate so far, moved here whole, + best.json
                             {"metric", "mode", "value", "version", "step", "judged_at"}  (written before the move)

Guarantees:
- The weights of an evaluated version are kept until it is judged: the trainer saves a candidate when it
  publishes a version the evaluator will evaluate (``v % every_versions == 0``, and version 0 with
  ``before_train``); when that version's row arrives the candidate becomes ``best/`` if its value improves on the
  best (``max``: strictly greater; ``min``: strictly smaller), else it is deleted. Candidates below a judged version
  are deleted too (the evaluator never goes back below a version it finished; it skips them when it is slower).
- At most ``pending_limit`` candidates wait on disk: holding one more deletes the oldest (the evaluator, when
  behind, evaluates the newest due version), and its row, should it arrive, is logged as not kept.
- ``best/`` is replaced by renames only (old ``best`` -> ``.best-old-*``, candidate -> ``best``), so a crash leaves
  either the old best or the new one; :class:`BestKeeper` puts an orphaned old best back at start. ``best/`` holds
  the same ``model.safetensors`` (and ``lora.json``) as a ``step-*`` checkpoint, so ``stream-rl export
  --checkpoint .../best`` exports it. Neither ``best/`` nor ``eval-pending/`` matches what checkpoint pruning or
  ``stream-rl gc`` removes (``step-*``, ``.tmp-*``, ``.del-*``).
- Restart-safe: at start the feed hands over every evaluation on the topic again; a row whose candidate is gone
  was judged before (or lost its weights) and changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from schemas import FINISH_REASONS  # finish/<reason> metrics
from stream_rl.storage.fsync import fsync_path

log = logging.getLogger(__name__)

PREFIX = "eval/"
BEST_DIR, PENDING_DIR = "best", "eval-pending"
BEST_FILE, CANDIDATE_FILE = "best.json", "candidate.json"
OLD_PREFIX = ".best-old-"
_CANDIDATE = re.compile(r"^v(\d{8})$")


def metric_key(keep_best: str) -> str:
    """The evaluation metrics key of ``trainer.keep_best``: ``"eval/heldout/greedy/accuracy"`` ->
    ``"heldout/greedy/accuracy"``."""
    if not keep_best.startswith(PREFIX) or keep_best.count("/") < 2:
        raise ValueError(f"trainer.keep_best: {keep_best!r} is not of the form eval/<set>/<metric>")
    return keep_best[len(PREFIX):]


def improves(value: float, best: float | None, mode: str) -> bool:
    """Whether ``value`` beats ``best`` (None: nothing kept yet): ``max`` -> ``value > best``; ``min`` ->
    ``value < best``; ties keep the earlier version."""
    if mode not in ("max", "min"):
        raise ValueError(f"trainer.keep_best_mode: {mode!r} is not 'max' or 'min'")
    if best is None:
        return True
    return value > best if mode == "max" else value < best


def is_due(version: int, every_versions: int, before_train: bool) -> bool:
    """Whether the evaluator evaluates ``version``: ``v > 0 and v % every == 0``, or ``v == 0`` with before_train."""
    return before_train if version == 0 else version % every_versions == 0


def set_metric_names(n: int, ks: Iterable[int], greedy: bool, extractor: bool) -> set[str]:
    """The metric names one set's evaluation produces (:mod:`stream_rl.evaluation.metrics`, plus
    ``reward_errors``), e.g. ``{"mean@4", "pass@1", "greedy/accuracy", ...}``."""
    names = {"prompts", f"mean@{n}", "length/mean", "reward_errors"} | {f"finish/{r}" for r in FINISH_REASONS}
    for k in ks:
        names.add(f"pass@{k}")
        if extractor:
            names.add(f"maj@{k}")
    if greedy:
        names |= {"greedy/accuracy", "greedy/reward"}
    return names


def keep_best_problem(keep_best: str, sets: Iterable[str], metric_names: set[str]) -> str | None:
    """Why no evaluation produces ``keep_best`` (None: one does). ``<set>/<metric>`` and the per-data-source
    ``<set>/<source>/<metric>`` are accepted (sources are known only once the set is read)."""
    sets = sorted(sets)
    try:
        key = metric_key(keep_best)
    except ValueError as exc:
        return str(exc)
    name, _, metric = key.partition("/")
    if name not in sets:
        return f"trainer.keep_best={keep_best!r}: {name!r} is not an eval set (eval.sets: {sets or 'none'})"
    source_metric = metric.partition("/")[2]
    if metric in metric_names or source_metric in metric_names:
        return None
    return (f"trainer.keep_best={keep_best!r}: no evaluation produces metric {metric!r} for set {name!r} "
            f"(it produces {', '.join(sorted(metric_names))}, each also per data source as <source>/<metric>)")


@dataclass(frozen=True)
class Judgement:
    """What one evaluation row did: ``kept`` (now the best), ``worse``, ``no-weights`` (its candidate is
    gone) or ``no-metric`` (the row lacks the metric)."""

    version: int
    outcome: str
    value: float | None = None


class BestKeeper:
    """The trainer's side of ``trainer.keep_best`` (see the module docstring). One per checkpoint directory."""

    def __init__(self, root: Path, feed, metric: str, mode: str, every_versions: int,
                 before_train: bool, pending_limit: int = 3):
        """``feed.new_rows()`` returns the evaluation rows published since its last call (the first call: all)."""
        self.root, self.feed, self.mode = Path(root), feed, mode
        self.key = metric_key(metric)
        self.metric = metric
        self.every, self.before_train, self.pending_limit = every_versions, before_train, pending_limit
        self.best_dir, self.pending_dir = self.root / BEST_DIR, self.root / PENDING_DIR
        self._backlog = True  # the rows present at start were (mostly) judged before
        self._recover()

    # -- state ---------------------------------------------------------------------------------------------------

    @property
    def best(self) -> dict | None:
        """The ``best.json`` record of the version kept, or None."""
        path = self.best_dir / BEST_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def pending(self) -> dict[int, Path]:
        """Candidates waiting for their evaluation, by version."""
        if not self.pending_dir.is_dir():
            return {}
        found = ((_CANDIDATE.match(p.name), p) for p in self.pending_dir.iterdir())
        return {int(m.group(1)): p for m, p in found if m and (p / CANDIDATE_FILE).is_file()}

    def _recover(self) -> None:
        """A crash between the two renames of a promotion: put the old best back; otherwise drop old copies."""
        if not self.root.is_dir():
            return
        for old in sorted(self.root.glob(OLD_PREFIX + "*")):
            if not self.best_dir.exists():
                os.rename(old, self.best_dir)
                fsync_path(self.root)
            else:
                shutil.rmtree(old)

    # -- the trainer's calls -------------------------------------------------------------------------------------

    def hold(self, version: int, step: int, write: Callable[[Path], None]) -> Path | None:
        """If ``version`` is due for evaluation, save its weights as a candidate (``write(dir)`` writes them, then
        ``candidate.json`` is written last); returns the candidate's directory, or None when not due."""
        if not is_due(version, self.every, self.before_train):
            return None
        final = self.pending_dir / f"v{version:08d}"
        if (final / CANDIDATE_FILE).is_file():
            return final  # a resumed trainer re-holding a version it saved before
        if final.exists():
            shutil.rmtree(final)  # an incomplete candidate from a crash
        final.mkdir(parents=True)
        write(final)
        _write_json(final / CANDIDATE_FILE, {"version": version, "step": step})
        fsync_path(final)
        fsync_path(self.pending_dir)
        self._limit_pending()
        return final

    def _limit_pending(self) -> None:
        pending = self.pending()
        for version in sorted(pending)[:-self.pending_limit]:
            log.warning("keep_best: dropping the weights of v%d, not evaluated yet (more than "
                        "trainer.keep_best_pending=%d versions wait for the evaluator)", version, self.pending_limit)
            shutil.rmtree(pending[version])

    def poll(self) -> list[Judgement]:
        """Judge every evaluation the feed hands over since the last call."""
        rows = self.feed.new_rows()
        backlog, self._backlog = self._backlog, False
        return [self.judge(row, quiet=backlog) for row in rows]

    def judge(self, row: dict, quiet: bool = False) -> Judgement:
        """One evaluation: promote its candidate when it improves on the best, drop it (and older ones) else."""
        version, pending = row["version"], self.pending()
        value = (row.get("metrics") or {}).get(self.key)
        for older in [v for v in pending if v < version]:
            shutil.rmtree(pending.pop(older))  # passed over by the evaluator: never judged
        candidate = pending.get(version)
        if candidate is None:
            if not quiet:
                log.warning("keep_best: v%d was evaluated but its weights are gone; it cannot be kept", version)
            return Judgement(version, "no-weights", value)
        if not isinstance(value, (int, float)):
            log.warning("keep_best: the evaluation of v%d has no %s; not kept", version, self.metric)
            shutil.rmtree(candidate)
            return Judgement(version, "no-metric")
        best = self.best
        if not improves(float(value), None if best is None else best["value"], self.mode):
            shutil.rmtree(candidate)
            return Judgement(version, "worse", float(value))
        self._promote(candidate, {"metric": self.metric, "mode": self.mode, "value": float(value),
                                  "version": version, "step": row.get("step"), "judged_at": time.time()})
        log.info("keep_best: v%d is the best so far (%s = %.4g) -> %s", version, self.metric, value, self.best_dir)
        return Judgement(version, "kept", float(value))

    def _promote(self, candidate: Path, record: dict) -> None:
        _write_json(candidate / BEST_FILE, record)
        fsync_path(candidate)
        old = None
        if self.best_dir.exists():
            old = self.root / f"{OLD_PREFIX}{uuid.uuid4().hex[:8]}"
            os.rename(self.best_dir, old)
        os.rename(candidate, self.best_dir)
        fsync_path(self.root)
        fsync_path(self.pending_dir)
        if old is not None:
            shutil.rmtree(old)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, sort_keys=True, allow_nan=False))
    fsync_path(path)
