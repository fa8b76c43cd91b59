"""TensorBoard: event files under ``tracker_dir/tensorboard`` (torch's ``SummaryWriter``, package tensorboard).

Consumes: the calls of :class:`~stream_rl.telemetry.trackers.base.Tracker` from the tracker's thread.
Produces: scalars per step (``add_scalar``), evaluations at the step of the version they evaluated, the config as
one markdown text (``config`` at step 0), sample tables as markdown text (``samples``).
Guarantees: every ``log_metrics`` is flushed before it returns; a new writer's file sorts after every file already
in the directory; on a resume the writer is opened with
``purge_step``: TensorBoard's readers hide every event at or after it written before the restart, so the steps
re-trained after the checkpoint appear once, with their new values (``rewinds``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stream_rl.telemetry.trackers.base import Opened, Tracker


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    rewinds = True

    def open(self, run_id: str | None, purge_from: int | None) -> Opened:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = self.directory / "tensorboard"
        _after_existing_files(self.logdir)
        self.writer = SummaryWriter(str(self.logdir), purge_step=purge_from, flush_secs=5)
        return Opened(run_id or self.run_name, None)

    def log_params(self, params: Mapping[str, str]) -> None:
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + table, 0)
        self.writer.flush()

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_evaluation(self, step: int, metrics: Mapping[str, float]) -> None:
        self.log_metrics(step, metrics)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        keys = list(rows[0])
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r[k]).replace("|", "\\|").replace("\n", " ") for k in keys) + " |"
                  for r in rows]
        self.writer.add_text("samples", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _after_existing_files(logdir: Path) -> None:
    """Wait until the clock's second is past every event file's in ``logdir``: readers order the files by name
    (``events.out.tfevents.<unix second>.<host>.<pid>...``), and the purge of a resumed writer must come after the
    files it purges (a restart within the same second would otherwise sort by pid)."""
    stamps = [int(p.name.split(".")[3]) for p in logdir.glob("events.out.tfevents.*")
              if p.name.split(".")[3].isdigit()]
    if stamps and max(stamps) >= int(time.time()):
        time.sleep(max(stamps) + 1 - time.time())
