"""The trainer's JSON-lines files in ``run_dir``: step history (metrics, trained rollouts) and the re-queue log.

Consumes: rows (JSON-ready dicts) from the trainer loop, a step's metrics and its batcher (:func:`metrics_row`);
on ``--resume`` the files a previous process wrote.
Produces: ``metrics.jsonl`` and ``trained.jsonl`` (one line per step), and ``requeued.jsonl``: one line per prompt
the trainer re-queued, ``{"topic", "group_id", "prompt_id", "epoch", "attempt", "time"}`` with ``topic`` the
prompts topic and ``attempt`` the attempt of the re-queued prompt, appended after the broker acknowledged it.
Guarantees:
- One ``write`` per line: a crash tears at most the last line, and every reader here skips a torn line.
- A metrics row holds no NaN or infinity (JSON has none): a non-finite metric is written as null.
- :func:`truncate_steps` rewrites a step file atomically (tmp + rename), keeping the rows with ``step <=`` the
  checkpoint's step: the surviving history is what the restored state contains.
- The re-queue log is never truncated: a re-queue is on the broker whether or not a checkpoint saw it, so a
  resumed trainer reads every re-queue ever sent (:func:`read_requeues`) and never sends the same (prompt, epoch,
  attempt) again. A crash between the broker's acknowledgement and the line can repeat that one re-queue.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from schemas import Prompt

REQUEUE_LOG = "requeued.jsonl"


def append_line(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row, allow_nan=False) + "\n")  # one write: a crash tears at most the last line


def metrics_row(step: int, version: int, metrics: dict[str, float], batcher) -> dict[str, Any]:
    """One ``metrics.jsonl`` row: the step's metrics (a non-finite float as null), then the batcher's counters
    (``batcher/{name}_total``), its buffered and ready groups, and the ledger's distinct prompts and top epoch."""
    counters = {f"batcher/{k}_total": float(v) for k, v in batcher.counters.items()}
    return {"step": step, "policy_version": version, "time": time.time(),
            **{k: _finite(v) for k, v in sorted(metrics.items())}, **counters,
            "batcher/buffered_groups": batcher.buffered_groups,
            "batcher/ready_groups": batcher.ready_groups,
            "data/distinct_prompts": float(batcher.ledger.prompts()),
            "data/epoch": float(batcher.ledger.top_epoch())}


def _finite(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else None


def _rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """``(line, row)`` for every whole JSON-object line of ``path`` ([] if it does not exist)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append((line, row))
    return rows


def truncate_steps(path: Path, last_step: int) -> int:
    """Rewrite the JSON-lines file ``path`` atomically, keeping the rows with ``step <= last_step``; a torn
    (undecodable) line is dropped. Returns the number of rows kept (0 if the file does not exist)."""
    if not path.is_file():
        return 0
    kept = [line + "\n" for line, row in _rows(path) if row.get("step", 0) <= last_step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(kept)


def log_requeues(path: Path, topic: str, prompts: Iterable[Prompt]) -> None:
    """Append one line per prompt re-queued on ``topic`` (call it after the broker acknowledged them)."""
    lines = "".join(json.dumps({"topic": topic, "group_id": p.group_id, "prompt_id": p.prompt_id,
                                "epoch": p.epoch, "attempt": p.attempt, "time": time.time()}) + "\n"
                    for p in prompts)
    if lines:
        with open(path, "a") as fh:
            fh.write(lines)


def read_requeues(path: Path, topic: str) -> dict[str, int]:
    """``{group_id: highest attempt re-queued}`` on ``topic`` from the re-queue log ({} if there is none; lines
    of another run's prompts topic are ignored)."""
    out: dict[str, int] = {}
    for _, row in _rows(path):
        gid, attempt = row.get("group_id"), row.get("attempt")
        if row.get("topic") == topic and isinstance(gid, str) and isinstance(attempt, int):
            out[gid] = max(attempt, out.get(gid, 0))
    return out
