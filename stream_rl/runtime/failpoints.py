"""Crash points for recovery drills: a process dies (SIGKILL, as by ``kill -9``) at an exact place in its work.

Consumes: the environment variable ``SRL_FAILPOINTS_DIR`` (not ``STREAM_RL_*``: that prefix is config) naming a
directory, and files in it named after a point (e.g. ``trainer.after_checkpoint``).
Produces: nothing, unless armed: :func:`hit` then deletes the file and kills its own process with SIGKILL.
Guarantees: one-shot (the file is removed before the kill, so a restarted process does not die again at the same
place); with the variable unset, :func:`hit` is one dictionary lookup and does nothing. Drills arm a point with
:func:`arm` (tests/integration/test_storm.py); production runs never set the variable.

Points: ``trainer.after_checkpoint`` (a checkpoint is complete, its offsets not yet committed),
``weights.mid_publish`` (a version's payload is on the broker or in the store, its manifest not yet sent) and
``producer.after_send`` (a batch's groups are flushed to the rollouts topic, its prompts not yet committed) and
``producer.after_partials`` (a batch's cut groups' prefixes are on the partials topic and its prompts committed,
nothing of them resumed yet).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ENV = "SRL_FAILPOINTS_DIR"


def hit(name: str) -> None:
    """Die here (SIGKILL) if the point ``name`` is armed; otherwise return at once."""
    root = os.environ.get(ENV)
    if not root:
        return
    path = Path(root) / name
    try:
        path.unlink()
    except FileNotFoundError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def arm(root: Path, name: str) -> Path:
    """Arm ``name`` under ``root`` (the directory processes see as ``SRL_FAILPOINTS_DIR``)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / name
    path.write_text("armed\n")
    return path
