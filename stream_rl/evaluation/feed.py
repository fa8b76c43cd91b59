"""The trainer's reader of the run's evals topic: the evaluations ``trainer.keep_best`` judges and the experiment
trackers log (each holds its own feed), from the broker.

Consumes: the evals topic ``{prefix}.{run}.evals`` (:class:`~schemas.Evaluation` records keyed by ``str(version)``,
published by the evaluator's :class:`~stream_rl.evaluation.ledger.Ledger`), through a group-less
:class:`~stream_rl.transport.reader.Reader`.
Produces: :meth:`EvalsFeed.new_rows` -> the rows (:func:`~stream_rl.evaluation.ledger.row_of`: ``version``,
``step``, ``metrics``, ...) of the evaluations published since the previous call; the first call returns every
evaluation already on the topic (the backlog). :func:`evaluation_rows` is the pure step: records in, rows and the
reasons of the records skipped out.
Guarantees:
- Roles talk only through topics: nothing here reads ``RUN_DIR/evals.jsonl``, so the trainer and the evaluator
  need not share a disk.
- A record that is not a valid ``Evaluation`` (undecodable bytes, another kind, an empty value, a batch the client
  cannot read) is skipped with a warning naming its partition, offset and reason; it never raises.
- Nothing is committed (no group): a restarted trainer reads the whole topic again, as it read the whole file
  before (:class:`~stream_rl.evaluation.best.BestKeeper` is restart-safe on a re-read; each tracker skips the
  versions its state file says it logged).
- After the backlog, a call never waits: it hands out what the client has fetched so far (possibly nothing).
- Within one call rows come in version order (the topic may have several partitions), and a version handed out
  before is not handed out again (the evaluator evaluates a version once; a second record is a retried send).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas import SchemaError, decode
from stream_rl.evaluation.ledger import ensure_evals_topic, row_of

log = logging.getLogger(__name__)


@dataclass
class EvalRows:
    """What :func:`evaluation_rows` made of some records: the new rows, and ``(where, reason)`` of each skip."""

    rows: list[dict] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def evaluation_rows(records: Iterable, seen: set[int]) -> EvalRows:
    """The rows of the valid evaluations among ``records`` (:class:`~stream_rl.transport.reader.Record` or
    :class:`~stream_rl.transport.unreadable.SkippedRecord`) whose version is not in ``seen`` (updated), in version
    order; every other record is listed in ``skipped`` with its reason."""
    out = EvalRows()
    for rec in records:
        where = f"{rec.topic}[{rec.partition}]@{rec.offset}"
        reason = getattr(rec, "reason", None)
        if reason is not None:  # an unreadable batch
            out.skipped.append((where, f"unreadable: {reason}"))
            continue
        if rec.value is None:
            out.skipped.append((where, "no value"))
            continue
        try:
            msg = decode(rec.value, "evaluation")
        except (SchemaError, TypeError, ValueError) as exc:
            out.skipped.append((where, f"not an evaluation: {exc}"))
            continue
        if msg.version in seen:
            out.skipped.append((where, f"v{msg.version} was read before"))
            continue
        seen.add(msg.version)
        out.rows.append(row_of(msg))
    out.rows.sort(key=lambda row: row["version"])
    return out


class EvalsFeed:
    """Follows the evals topic from its first record (module docstring). Close it when done."""

    def __init__(self, reader, topic: str, timeout_s: float = 10.0):
        self.reader, self.topic, self.timeout_s = reader, topic, timeout_s
        self.seen: set[int] = set()
        self._following = False

    @classmethod
    def open(cls, transport) -> EvalsFeed:
        """A feed of ``transport``'s run's evals topic (created when missing, as the evaluator creates it)."""
        return cls(transport.reader(), ensure_evals_topic(transport), transport.cfg.kafka.broker_timeout_s)

    def new_rows(self) -> list[dict]:
        """The rows of the evaluations published since the last call (the first call: all of them)."""
        records = self.reader.poll(0.0) if self._following else self._backlog()
        batch = evaluation_rows(records, self.seen)
        for where, reason in batch.skipped:
            log.warning("skipping evals record %s: %s", where, reason)
        return batch.rows

    def _backlog(self) -> list:
        """Every record up to the high-water marks, then follow each partition from there."""
        records, start = [], {}
        for partition in self.reader.partitions(self.topic, self.timeout_s):
            start[partition] = 0
            for rec in self.reader.read_range(partition, 0, None, self.timeout_s):
                records.append(rec)
                start[partition] = rec.offset + 1
        self.reader.follow(start)
        self._following = True
        return records

    def close(self) -> None:
        self.reader.close()
