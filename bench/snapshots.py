"""The policy after every K-th step of a benchmark run, kept for scoring after the run (benchmark 18).

Consumes: a run's step budget and ``K`` (:class:`bench.trl_peer.Workload`), and either TRL's worker's saves
(``--save-every``) or the weights store of a running ``stream-rl run`` (``run_dir/weights``, where version ``N``,
the policy after ``N`` steps, is ``v{N:08d}.safetensors`` until the trainer's garbage collection removes it).
Produces: :func:`keeping`, a context manager that hard-links each wanted version out of the store as it appears,
so the run keeps its own garbage collection (``weights.keep_last``) and pays nothing for the snapshots; and
:func:`snapshots`, step -> file.
Guarantees: a wanted version missing at the end raises naming the folder and the steps; a link is of a complete
file (the store renames a version into place whole).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

POLL_S = 0.05  # a version lives in the store for at least keep_last (3) steps of ~0.3 s: far longer than this


def wanted(steps: int, every: int) -> list[int]:
    """Every ``every``-th step up to ``steps`` (none when ``every`` is 0)."""
    return list(range(every, steps + 1, every)) if every else []


def name(step: int) -> str:
    return f"v{step:08d}.safetensors"


def snapshots(folder: Path, steps: int, every: int) -> dict[int, Path]:
    """Step -> ``folder/v{step:08d}.safetensors`` for every wanted step; RuntimeError naming the folder and the
    steps when one is missing."""
    found = {step: folder / name(step) for step in wanted(steps, every)}
    missing = sorted(step for step, path in found.items() if not path.is_file())
    if missing:
        raise RuntimeError(f"{folder}: no weights after steps {missing}")
    return found


@contextlib.contextmanager
def keeping(store: Path, dest: Path, steps: int, every: int) -> Iterator[Path]:
    """While the block runs, hard-link each wanted version of ``store`` into ``dest`` as soon as it is there (a
    thread polling every :data:`POLL_S`); once more after the block. Yields ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    left = set(wanted(steps, every))
    stop = threading.Event()

    def sweep() -> None:
        for step in sorted(left):
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                os.link(store / name(step), dest / name(step))
            if (dest / name(step)).is_file():
                left.discard(step)

    def poll() -> None:
        while left and not stop.wait(POLL_S):
            sweep()

    thread = threading.Thread(target=poll, name="snapshot-keeper", daemon=True)
    thread.start()
    try:
        yield dest
    finally:
        stop.set()
        thread.join()
        sweep()
