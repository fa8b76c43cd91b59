"""Run directories as `stream-rl run` leaves them under runs/, for the tests of run selection."""

from __future__ import annotations

import os
from pathlib import Path

RUNS = ("demo-20261201-101500", "demo-20261202-090000", "demo-20261130-235959")
NEWEST = "demo-20261202-090000"


def make_runs(root: Path, names=RUNS) -> dict[str, Path]:
    """Run directories as `stream-rl run` leaves them (config.yaml first), the second one written last."""
    dirs = {}
    for i, name in enumerate(names):
        d = root / "runs" / name
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(f"run_dir: runs/{name}\ntopics:\n  run: {name}\n")
        when = 1_800_000_000 + (1000 if name == NEWEST else -i)  # then in the order given
        os.utime(d / "config.yaml", (when, when))
        dirs[name] = d
    (root / "runs" / "demo-model").mkdir()  # the demo's build directory: no config.yaml, not a run
    return dirs
