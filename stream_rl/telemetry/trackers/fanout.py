"""What the trainer holds: one :class:`~stream_rl.telemetry.trackers.worker.TrackerWorker` per configured tracker.

Consumes: the root config (``telemetry.*``, ``topics.run``, ``run_dir``), the checkpoint's step on a resume (the
trainer's ``metrics.jsonl`` is already truncated to it), the trainer's transport (its run's evals topic, followed by
an :class:`~stream_rl.evaluation.feed.EvalsFeed`: the evaluations the evaluator publishes, as rows ``{"version",
"step", "metrics": {"<set>/<metric>": value}}``), then from the trainer's thread each step's ``metrics.jsonl`` row
and its scored rollouts.
Produces: the calls of every worker: hyper-parameters (the resolved config, ``SecretStr`` values masked by
pydantic as ``**********``), each row's finite scalars plus ``trainer/step``, evaluations at their step, sample
tables every ``telemetry.log_samples`` steps.
Guarantees: no call blocks (bounded queues, background threads; the evals topic's backlog is read once, at open,
and logged with the first step, as a later evaluation is logged after the step it arrived in; after the backlog
each step only takes what the client has already fetched); with ``telemetry.trackers`` empty nothing
is started, no reader is opened and every call returns at once; roles talk only through topics: nothing here reads
the evaluator's ``evals.jsonl``, so the trainer and the evaluator need not share a disk;
:meth:`Trackers.log_evaluation` is the stable API for evaluations (``step``: the trainer step of the evaluated
version; ``metrics``: ``eval/<set>/<metric>`` names; ``version``: the key that makes it exactly-once across
restarts, as the feed hands the whole topic over again at each start).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from stream_rl.evaluation.feed import EvalsFeed
from stream_rl.telemetry.trackers import backend
from stream_rl.telemetry.trackers.base import STEP_KEY, evaluation_metrics, hyperparams, sample_rows, scalars
from stream_rl.telemetry.trackers.worker import TrackerWorker

log = logging.getLogger(__name__)


class Trackers:
    """The fan-out (see the module docstring). ``Trackers.open(cfg, resume_step, transport)`` or ``Trackers([])``."""

    def __init__(self, workers: list[TrackerWorker], *, samples_every: int = 0, sample_rows_max: int = 8,
                 show_content: bool = False, evals: EvalsFeed | None = None):
        self.workers = workers
        self.samples_every, self.sample_rows_max, self.show_content = samples_every, sample_rows_max, show_content
        self.evals = evals
        self.backlog = evals.new_rows() if evals is not None else []  # the feed's first call: read, not logged yet

    @classmethod
    def open(cls, cfg, resume_step: int | None, transport=None) -> Trackers:
        """The trackers of ``cfg.telemetry.trackers``; ``resume_step``: the checkpoint's step on a resume (0 when
        resuming without a checkpoint), None on a fresh start (new tracker runs); ``transport``: the run whose
        evals topic is followed (None: evaluations come only through :meth:`log_evaluation`). The topic's
        backlog is read here, before the first step."""
        tcfg = cfg.telemetry
        if not tcfg.trackers:
            return cls([])
        run_dir = Path(cfg.run_dir)
        directory = Path(tcfg.tracker_dir or run_dir / "trackers")
        directory.mkdir(parents=True, exist_ok=True)
        params = hyperparams(cfg.model_dump(mode="json"))
        history = history_rows(run_dir / "metrics.jsonl") if resume_step is not None else []
        workers = [TrackerWorker(backend(name)(directory, tcfg.tracker_project, cfg.topics.run),
                                 resume_step=resume_step, params=params, history=history,
                                 queue_size=tcfg.tracker_queue, retry_s=tcfg.tracker_retry_s)
                   for name in tcfg.trackers]
        log.info("trackers %s under %s", ", ".join(tcfg.trackers), directory)
        return cls(workers, samples_every=tcfg.log_samples, sample_rows_max=tcfg.log_sample_rows,
                   show_content=tcfg.log_sample_content,
                   evals=EvalsFeed.open(transport) if transport is not None else None)

    def log_step(self, row: Mapping[str, Any], scored: Iterable[Any] = ()) -> None:
        """One ``metrics.jsonl`` row (and, every ``log_samples`` steps, a table of ``scored``); then the
        evaluations published since the last call."""
        if not self.workers:
            return
        step = int(row["step"])
        metrics = {**scalars(row), STEP_KEY: float(step)}
        for w in self.workers:
            w.submit("metrics", step, metrics)
        if self.samples_every and step % self.samples_every == 0:
            rows = sample_rows(scored, self.sample_rows_max, self.show_content)
            for w in self.workers:
                w.submit("samples", step, rows)
        self.follow_evaluations()

    def log_evaluation(self, step: int, metrics: Mapping[str, float], version: int | None = None) -> None:
        """An evaluation of the policy trained for ``step`` steps (``metrics``: ``eval/<set>/<metric>``)."""
        values = scalars(metrics)
        for w in self.workers:
            w.submit("evaluation", int(step), values, version)

    def follow_evaluations(self) -> None:
        """Log the evaluations the evals feed handed over since the last call (the first call: also the backlog
        read at open); only what the client has already fetched: it never waits for the evaluator."""
        if self.evals is None:
            return
        rows, self.backlog = self.backlog + self.evals.new_rows(), []
        for row in rows:  # valid Evaluations only, each version once, in version order
            self.log_evaluation(row["step"], evaluation_metrics(row), row["version"])

    def close(self, timeout_s: float = 30.0) -> None:
        """Log the evaluations already fetched, give each tracker up to ``timeout_s`` to log what is queued, then
        close it and the evals feed."""
        self.follow_evaluations()
        for w in self.workers:
            w.close(timeout_s)
        self.workers = []
        if self.evals is not None:
            self.evals.close()
            self.evals = None


def history_rows(path: Path) -> list[tuple[int, dict[str, float]]]:
    """``(step, scalars + trainer/step)`` of every whole row of a ``metrics.jsonl`` file ([] if none)."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            continue
        out.append((step, {**scalars(row), STEP_KEY: float(step)}))
    return out
