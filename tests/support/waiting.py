"""One way to wait in a test: poll a condition until it holds or a deadline passes, failing at once when a
watched worker died.

Prefer a deterministic check (an offset, a high-water mark, a count) as the condition over sleeping for a window.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

V = TypeVar("V")


def wait_for(predicate: Callable[[], V], what: str, timeout_s: float = 60.0, *, watch: Iterable[Any] = (),
             interval_s: float = 0.1) -> V:
    """Poll ``predicate`` every ``interval_s`` until it returns something truthy, and return that.

    Raises AssertionError naming ``what`` after ``timeout_s``. Each item of ``watch`` is checked before every poll
    and its error re-raised at once: an object with an ``error`` attribute (a role thread) or a dict with an
    ``"error"`` key (what a worker thread filled in)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for worker in watch:
            error = worker.get("error") if isinstance(worker, dict) else getattr(worker, "error", None)
            if error is not None:
                raise error
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)
