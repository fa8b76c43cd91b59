"""What was evaluated: the run's evals topic (the source of truth, keyed by version) and ``RUN_DIR/evals.jsonl``.

Consumes: a :class:`~stream_rl.transport.client.Transport` (its group-less reader and a sink) and the run dir.
Produces: ``read_done`` -> ``{version: Evaluation}`` from the whole evals topic; ``Ledger.record`` publishes one
``Evaluation`` (key ``str(version)``), waits for the broker's ack, then appends its row to ``evals.jsonl``.
Guarantees:
- The topic is written first and acknowledged before the file: after a kill -9 the topic holds every evaluation
  whose row may be missing, and :meth:`Ledger.sync_file` (run at start) appends the rows the file lacks, so the file
  ends up with exactly one row per evaluated version (a row already there is never written twice).
- Invalid records on the evals topic are skipped with a warning (this reader has no dead-letter sink).
- Rows carry ``version``, ``step`` (the trainer step that produced the version), ``sets``, ``metrics``,
  ``elapsed_s``, ``created_at`` and ``skipped_versions``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from schemas import Evaluation, SchemaError, decode

log = logging.getLogger(__name__)

LOGICAL = "evals"
FILE_NAME = "evals.jsonl"


def evals_topic(transport) -> str:
    """The run's evals topic ``{prefix}.{run}.evals``."""
    return transport.names.name(LOGICAL)


def ensure_evals_topic(transport) -> str:
    """Create the evals topic when missing (partitions from ``topics.partitions['evals']``); its full name."""
    topic = evals_topic(transport)
    transport.ensure_topics(extra={topic: transport.cfg.topics.partitions.get(LOGICAL, 1)})
    return topic


def read_done(transport, topic: str, timeout_s: float = 10.0) -> dict[int, Evaluation]:
    """Every valid Evaluation on ``topic`` up to its high-water mark, by version (the last record of a version)."""
    done: dict[int, Evaluation] = {}
    with transport.reader() as reader:
        for partition in reader.partitions(topic, timeout_s):
            for rec in reader.read_range(partition, 0, None, timeout_s):
                try:
                    msg = decode(rec.value, "evaluation")
                except (SchemaError, TypeError) as exc:
                    log.warning("evals: skipping invalid record %s@%s: %s", partition, getattr(rec, "offset", "?"),
                                exc)
                    continue
                done[msg.version] = msg
    return done


def row_of(msg: Evaluation, skipped: list[int] | None = None) -> dict:
    """The ``evals.jsonl`` row of one evaluation."""
    return {"version": msg.version, "step": msg.step, "sets": list(msg.sets), "metrics": dict(msg.metrics),
            "elapsed_s": msg.elapsed_s, "created_at": msg.created_at, "evaluator_id": msg.evaluator_id,
            "skipped_versions": list(skipped or [])}


def read_rows(path: Path) -> list[dict]:
    """The rows of an ``evals.jsonl`` (a torn last line, from a kill -9 mid-write, is ignored)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class Ledger:
    """Publishes evaluations and mirrors them into ``run_dir/evals.jsonl``."""

    def __init__(self, sink, topic: str, run_dir: Path):
        self.sink, self.topic = sink, topic
        self.path = Path(run_dir) / FILE_NAME

    def record(self, msg: Evaluation, skipped: list[int] | None = None) -> None:
        """Send, wait for the ack, then append the row (fsynced)."""
        self.sink.send(self.topic, msg, key=str(msg.version))
        self.sink.flush()
        self._append(row_of(msg, skipped))

    def sync_file(self, done: dict[int, Evaluation]) -> int:
        """Append the rows of topic evaluations the file lacks; how many were appended."""
        have = {row.get("version") for row in read_rows(self.path)}
        missing = [done[v] for v in sorted(done) if v not in have]
        for msg in missing:
            self._append(row_of(msg))
        return len(missing)

    def _append(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = self.path.read_bytes() if self.path.exists() else b""
        with self.path.open("a") as f:
            if text and not text.endswith(b"\n"):  # a torn line from a kill -9: start on a fresh line
                f.write("\n")
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
