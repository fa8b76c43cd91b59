"""Progress output for `demo init`: phase lines and a warm-start progress bar with an ETA, on stderr.

Consumes: `SFTProgress` snapshots from `supervised_warm_start` and phase names from `init_demo`.
Produces: text on a stream (stderr by default). On a terminal the warm-start redraws one bar in place
(`\\r`, at most 5 times a second); elsewhere (a pipe, a log file, `stream-rl run`'s output) it prints one line
per accuracy check, at most one line per `line_every_s` in between, and one at the end, so a log shows
progress without carriage returns.

Guarantees: every line names steps done/total, the elapsed time and an ETA. The ETA extrapolates the mean time
per step so far to `max_steps` (and is capped by `max_seconds`); it is marked `<=` because the warm-start stops
early once the sampled accuracy reaches its target. Writing progress never raises into the build: a closed
or broken stream turns the output off.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

BAR_WIDTH = 24
TTY_REDRAW_S = 0.2


@dataclass(frozen=True)
class SFTProgress:
    """One warm-start step, as `supervised_warm_start` reports it to its `on_step` callback."""

    step: int
    max_steps: int
    loss: float
    elapsed_s: float
    max_seconds: float | None
    target_accuracy: float
    accuracy: float | None = None
    """The sampled accuracy measured at this step, when this step was a check; else None."""
    last: bool = False
    """True on the step after which training stops."""


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta_seconds(p: SFTProgress) -> float:
    """Upper bound of the time left: mean time per step so far times the steps left, capped by max_seconds."""
    if p.last or p.step >= p.max_steps:
        return 0.0
    left = (p.max_steps - p.step) * p.elapsed_s / max(p.step, 1)
    if p.max_seconds is not None:
        left = min(left, max(p.max_seconds - p.elapsed_s, 0.0))
    return left


def describe(p: SFTProgress, last_accuracy: float | None) -> str:
    """`step 120/1000 loss 0.834 accuracy 0.12 (stops at 0.20) 1m02s elapsed, ETA <= 7m30s`."""
    acc = "accuracy -" if last_accuracy is None else f"accuracy {last_accuracy:.2f}"
    eta = "done" if p.last else f"ETA <= {format_duration(eta_seconds(p))}"
    return (f"step {p.step}/{p.max_steps} loss {p.loss:.3f} {acc} (stops at {p.target_accuracy:.2f}) "
            f"{format_duration(p.elapsed_s)} elapsed, {eta}")


class DemoProgress:
    """Writes `demo init`'s progress to `stream` (default: `sys.stderr` at construction)."""

    def __init__(self, stream: TextIO | None = None, *, line_every_s: float = 10.0, tty: bool | None = None):
        self.stream = sys.stderr if stream is None else stream
        self.tty = _isatty(self.stream) if tty is None else tty
        self.line_every_s = line_every_s
        self._last_write = float("-inf")
        self._last_accuracy: float | None = None
        self._open_bar = False
        self._started = time.perf_counter()

    def phase(self, text: str) -> None:
        """One line: `demo init [12s]: text`."""
        self._end_bar()
        self._write(f"demo init [{format_duration(time.perf_counter() - self._started)}]: {text}\n")

    def sft_step(self, p: SFTProgress) -> None:
        """The `on_step` callback of `supervised_warm_start`."""
        if p.accuracy is not None:
            self._last_accuracy = p.accuracy
        now = time.perf_counter()
        due = now - self._last_write >= (TTY_REDRAW_S if self.tty else self.line_every_s)
        if not (due or p.last or p.accuracy is not None or p.step == 1):
            return
        self._last_write = now
        text = describe(p, self._last_accuracy)
        if self.tty:
            done = BAR_WIDTH if p.last else BAR_WIDTH * p.step // max(p.max_steps, 1)
            self._write(f"\r  [{'#' * done}{'.' * (BAR_WIDTH - done)}] {text}\033[K")
            self._open_bar = True
            if p.last:
                self._end_bar()
        else:
            self._write(f"  warm-start {text}\n")

    def _end_bar(self) -> None:
        if self._open_bar:
            self._open_bar = False
            self._write("\n")

    def _write(self, text: str) -> None:
        if self.stream is None:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: stop reporting, keep building
            self.stream = None


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
