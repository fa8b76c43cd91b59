"""Weights & Biases: offline files under ``tracker_dir/wandb`` with no key, online when the user configures it.

Consumes: the calls of :class:`~stream_rl.telemetry.trackers.base.Tracker` from the tracker's thread; the
environment (``WANDB_MODE``; without it the mode is ``online`` when ``WANDB_API_KEY`` is set, else ``offline``).
Produces: one run (project ``tracker_project``, name ``topics.run``, a stable id kept by the worker) with the
config, one history row per step (``step=`` the trainer step), evaluations with their own x-axis
(``eval/step``, ``define_metric``: W&B's step only grows, and an evaluation arrives after later steps), sample
tables (``wandb.Table`` under ``samples``).
Guarantees: ``open`` reports the highest step the run holds: in offline mode read from the run's own ``.wandb``
files (:func:`offline_steps`), online from the resumed run's step; a step the run holds is never logged again.
"""

from __future__ import annotations

import glob
import os
import secrets
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from stream_rl.telemetry.trackers.base import Opened, Tracker

BLOCK, HEADER = 32768, 7  # the .wandb file: a 7-byte file header, then LevelDB-log records in 32 KiB blocks
FULL, LAST = 1, 4
FINISH_WAIT_S = 10.0


class WandbTracker(Tracker):
    name = "wandb"

    def open(self, run_id: str | None, purge_from: int | None) -> Opened:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.directory.mkdir(parents=True, exist_ok=True)
        run_id = run_id or secrets.token_hex(8)  # W&B ids: lowercase letters and digits
        held = max(offline_steps(self.directory, run_id), default=0) if mode == "offline" else 0
        self.run = wandb.init(project=self.project, name=self.run_name, id=run_id, dir=str(self.directory),
                              resume="allow", mode=mode, reinit="create_new",
                              settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        self.run.define_metric("eval/step")
        self.run.define_metric("eval/*", step_metric="eval/step")
        self.current = max(held, self.run.step - 1 if self.run.step > 0 else 0)
        return Opened(run_id, self.current)

    def log_params(self, params: Mapping[str, str]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)
        self.current = step

    def log_evaluation(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({**metrics, "eval/step": step}, step=self.current, commit=False)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        if rows:
            keys = list(rows[0])
            table = wandb.Table(columns=["step", *keys], data=[[step, *(r[k] for k in keys)] for r in rows])
            self.run.log({"samples": table}, step=max(step, self.current), commit=False)

    def close(self) -> None:
        """Finish the run; offline, also wait (at most ``FINISH_WAIT_S``) until W&B's service has ended the run's
        file with its exit record, so that a resume right after reads every step it holds."""
        path = Path(self.run.dir).parent / f"run-{self.run.id}.wandb"
        offline = self.run.settings.mode == "offline"
        self.run.finish()
        deadline = time.monotonic() + FINISH_WAIT_S
        while offline and time.monotonic() < deadline and not _ends_with_exit(path):
            time.sleep(0.05)


def _ends_with_exit(path: Path) -> bool:
    records = list(read_records(path)) if path.is_file() else []
    return bool(records) and records[-1].WhichOneof("record_type") == "exit"


def offline_steps(root: Path, run_id: str) -> Iterator[int]:
    """The history steps in every offline session of run ``run_id`` under ``root`` (``root/wandb/offline-run-*``,
    where ``wandb.init(dir=root)`` writes)."""
    for path in sorted(glob.glob(str(Path(root) / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))):
        for record in read_records(Path(path)):
            if record.WhichOneof("record_type") == "history":
                yield int(record.history.step.num)


def read_records(path: Path) -> Iterator[Any]:
    """The protobuf ``Record`` messages of one ``.wandb`` file (W&B's own ``wandb_internal_pb2``); a record torn
    by a crash ends the file."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        if len(chunk) < length:
            return
        pos, pending = pos + HEADER + length, pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record
