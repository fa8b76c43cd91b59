"""One tracker's background thread: a bounded queue in front of a backend, exactly-once steps, retry with backoff.

Consumes: calls ``submit(kind, step, payload, version)`` from the trainer's thread (``kind``: ``metrics``,
``evaluation``, ``samples``); at start the tracker's state file (``<tracker_dir>/<name>.json``: run id, last step
and last evaluated version logged) when resuming, the config as hyper-parameters and the ``metrics.jsonl`` rows
the checkpoint covers.
Produces: the backend's calls, in order, on this thread; the state file rewritten (tmp + rename) after every
step and evaluation the backend accepted.
Guarantees:
- ``submit`` never blocks: a full queue drops the call, counts it (``dropped``) and warns once.
- Opening and every call are retried: the first failure is one warning line naming the tracker and the field
  (``telemetry.trackers``), then the same call is retried after ``retry_s``, doubling up to 60x, until it
  succeeds (an info line says so) or the worker is closed. A call the backend refuses for its content
  (``Tracker.retriable`` false, e.g. a name MLflow rejects) is dropped with a warning naming it.
- Steps: on opening, :func:`~stream_rl.telemetry.trackers.base.first_step` decides the first step logged; the
  history rows from it up to the checkpoint's step are logged from ``metrics.jsonl``, then the live rows; a step
  at or below the last one logged is skipped, so each step reaches the backend once (see base.first_step for
  which values a re-trained step keeps). Evaluations are skipped when their version is at or below the last
  evaluated version logged.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stream_rl.telemetry.trackers.base import Tracker, first_step

log = logging.getLogger(__name__)
STOP = object()
MAX_BACKOFF = 60


def read_state(path: Path) -> dict[str, Any]:
    """The state file's dict ({} when it is missing or unreadable)."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def write_state(path: Path, state: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(dict(state)))
    os.replace(tmp, path)


class TrackerWorker:
    """Feeds one :class:`~stream_rl.telemetry.trackers.base.Tracker` from its own daemon thread."""

    def __init__(self, tracker: Tracker, *, resume_step: int | None, params: Mapping[str, str],
                 history: Sequence[tuple[int, Mapping[str, float]]], queue_size: int, retry_s: float):
        self.tracker, self.retry_s = tracker, retry_s
        self.params: dict[str, str] | None = dict(params)
        self.state_path = tracker.directory / f"{tracker.name}.json"
        self.state = read_state(self.state_path) if resume_step is not None else {}
        self.resume_step = resume_step or 0
        self.history = list(history)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.opened, self.first = False, 1
        self.dropped, self.failures, self.warned, self.unlogged = 0, 0, False, 0
        self._closing, self._draining = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"tracker-{tracker.name}", daemon=True)
        self.thread.start()

    # -- the trainer's thread ----------------------------------------------------------------------------------

    def submit(self, kind: str, step: int, payload: Any, version: int | None = None) -> bool:
        try:
            self.queue.put_nowait((kind, step, payload, version))
            return True
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("tracker %s (telemetry.trackers): queue full (telemetry.tracker_queue), dropping "
                            "calls until it drains", self.tracker.name)
            return False

    def close(self, timeout_s: float) -> None:
        """Let the thread log what is queued for up to ``timeout_s`` (a failing tracker gets one more attempt, no
        backoff), then stop it and close the backend."""
        self._draining.set()
        try:
            self.queue.put(STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self.thread.join(timeout_s)
        self._closing.set()
        self.thread.join(1.0)
        left = self.unlogged + sum(1 for item in self._take_all() if item is not STOP)
        if left:
            log.warning("tracker %s: %d calls not logged at close", self.tracker.name, left)

    def _take_all(self) -> list:
        items = []
        while True:
            try:
                items.append(self.queue.get_nowait())
            except queue.Empty:
                return items

    # -- the worker's thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        item = None
        while not self._closing.is_set():
            if item is None:
                item = self.queue.get()
                if item is STOP:
                    break
            if self._attempt(item):
                item = None
            elif self._draining.is_set() or self._closing.wait(self._backoff()):
                self.unlogged = 1
                break
        if self.opened:
            try:
                self.tracker.close()
            except Exception as exc:  # noqa: BLE001 - a tracker never stops the trainer
                log.warning("tracker %s: close failed: %r", self.tracker.name, exc)

    def _attempt(self, item) -> bool:
        try:
            if not self.opened:
                self._open()
            if self.params is not None:
                self._log_params()
            while self.history:  # the rows the checkpoint covers, before any live call
                self._apply("metrics", *self.history[0], None)
                self.history.pop(0)
            self._apply(*item)
        except Exception as exc:  # noqa: BLE001 - a tracker library's failure is retried or dropped, never raised
            if self.opened and not self.tracker.retriable(exc):
                self.dropped += 1
                log.warning("tracker %s (telemetry.trackers) refused a %s call at step %d, dropped: %s: %s",
                            self.tracker.name, item[0], item[1], type(exc).__name__, exc)
                return True
            self.failures += 1
            if not self.warned:
                self.warned = True
                log.warning("tracker %s (telemetry.trackers) failed: %s: %s; retrying with backoff from %gs, the "
                            "run goes on", self.tracker.name, type(exc).__name__, exc, self.retry_s)
            return False
        if self.failures:
            log.info("tracker %s works again after %d failed attempts", self.tracker.name, self.failures)
            self.failures = 0
        return True

    def _backoff(self) -> float:
        return self.retry_s * min(2 ** max(self.failures - 1, 0), MAX_BACKOFF)

    def _open(self) -> None:
        t, logged = self.tracker, int(self.state.get("logged_step", 0))
        purge = first_step(True, 0, logged, self.resume_step) if t.rewinds else None
        opened = t.open(self.state.get("run_id"), purge)
        self.first = first_step(t.rewinds, opened.held_step, logged, self.resume_step)
        self.state.update(run_id=opened.run_id, logged_step=self.first - 1)
        write_state(self.state_path, self.state)  # a retry continues this run, never opens another
        self.opened = True

    def _log_params(self) -> None:
        try:
            self.tracker.log_params(self.params)
        except Exception as exc:  # noqa: BLE001 - refused: said once, the steps go on; else retried by _attempt
            if self.tracker.retriable(exc):
                raise
            log.warning("tracker %s (telemetry.trackers) refused the config as hyper-parameters: %s: %s",
                        self.tracker.name, type(exc).__name__, exc)
        self.params = None

    def _apply(self, kind: str, step: int, payload: Any, version: int | None) -> None:
        if kind == "metrics":
            if step <= self.state["logged_step"]:
                return
            self.tracker.log_metrics(step, payload)
            self.state["logged_step"] = step
        elif kind == "evaluation":
            if version is not None and version <= self.state.get("eval_version", -1):
                return
            self.tracker.log_evaluation(step, payload)
            if version is not None:
                self.state["eval_version"] = version
        else:
            self.tracker.log_samples(step, payload)
            return
        write_state(self.state_path, self.state)
