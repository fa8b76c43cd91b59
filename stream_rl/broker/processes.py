"""Lifecycle of the local processes the project starts itself (the broker and its object store).

Consumes: a PID plus a check that this PID still runs the command that was started (no PID-reuse surprise), JSON
state files, log files.
Produces: atomic state files, a bounded stop, one-line log tails for error messages.
Guarantees: :func:`stop` signals only while ``is_ours()`` holds (SIGTERM, then SIGKILL after ``timeout_s``) and
reaps the process when it is a child of this one; :func:`write_state` replaces the file atomically (tmp + rename),
so a reader never sees half a state.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def read_state(path: Path, cls: type[T], error: type[Exception], what: str) -> T | None:
    """The state recorded in ``path`` as ``cls(**json)``, None if there is none; ``error`` if it is unreadable."""
    if not path.is_file():
        return None
    try:
        return cls(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise error(f"{what} state file {path} is unreadable: {exc}") from exc


def write_state(path: Path, state: Any) -> None:
    """Write the dataclass ``state`` to ``path`` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(state)))
    tmp.replace(path)


def stop(pid: int, is_ours: Callable[[], bool], timeout_s: float) -> None:
    """SIGTERM ``pid`` while it is ours, then SIGKILL if it is still there after ``timeout_s``."""
    if not is_ours():
        return
    os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, is_ours, timeout_s):
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, is_ours, timeout_s)


def _wait_gone(pid: int, is_ours: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reaped, _ = os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
        except ChildProcessError:
            reaped = 0
        if reaped == pid or not is_ours():
            return True
        time.sleep(0.05)
    return False


def log_tail(path: Path, lines: int = 5) -> str:
    """The last ``lines`` lines of ``path`` joined with `` | `` (for a one-line error)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"
