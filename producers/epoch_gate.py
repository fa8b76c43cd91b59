"""Epoch order across partitions: no prompt of epoch e+1 is generated before every prompt of epoch e was.

``prompts load --epochs N`` writes each partition's prompts epoch by epoch, but producers read partition by
partition, so without a gate epoch 2 of one partition starts long before epoch 1 of another ends. The gate holds a
partition at its first *first-load* record (``attempt == 0``) of an epoch above the open one, until every
partition of the prompts topic is past the epochs below it.

Consumes: the prompts this producer polled; per partition of the prompts topic, where reading stands (this
producer's position on the partitions it is assigned, the producer group's committed offset on the others) and
the next first-load record from there (read with a group-less reader, nothing committed).
Produces: the records that may be generated now. A held partition is sought back to its first held record and
listed in :attr:`EpochGate.held`, which the producer's :class:`~stream_rl.transport.edge.Source` keeps paused
(``Source.holds``); the producer's commit leaves that record (and everything after it) for later, and the
producer goes on with its other partitions.
Guarantees:
- Epoch ``e`` opens when, in every partition, the next first-load record not yet taken (polled by this producer,
  or committed by another) is of epoch ``e`` or later, or there is none. A first-load record of an epoch above
  the open one is never handed out, so no prompt of epoch e+1 is generated while a first-load prompt of epoch e
  is still unread anywhere (prompts polled by another producer but not yet committed count as unread: the gate
  errs towards waiting, by at most one batch per epoch).
- Re-queued prompts (``attempt >= 1``, after a stale drop) keep their epoch and are never held on their own
  (they are late by nature); one that sits behind a held record in its partition waits with it.
- It holds across restarts and rebalances: it keeps no state beyond what the log and the group's offsets say;
  the open epoch only ever grows.
- Within a partition, order is kept: after a held record, nothing of that partition is handed out.
- No stall with backpressure: while a partition of another producer is idle at the open epoch (waiting at the
  boundary, or with nothing left), a producer over its budget goes on generating what its own partitions admit
  (:meth:`EpochGate.finishing`): the budget assumes every producer feeds its share, which an idle one does not.
  The overshoot is bounded by the open epoch's (and re-queued) prompts left in its partitions; a producer that
  owns every partition (one producer) is never lifted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """A partition held at ``offset``, its first first-load record of ``epoch`` (above the open epoch)."""

    offset: int
    epoch: int


def split_by_epoch(records: Sequence, open_epoch: int, held: dict | None = None) -> tuple[list, dict]:
    """Records that may go now, and the partitions to hold: ``{(topic, partition): Held}``.

    A partition is held from its first record with ``attempt == 0`` and ``epoch > open_epoch``; every later record
    of that partition is held with it. Partitions already in ``held`` hand out nothing (and stay as held)."""
    held = held or {}
    allowed, new = [], {}
    for rec in records:
        key = (rec.topic, rec.partition)
        if key in held or key in new:
            continue
        msg = rec.value
        if msg.attempt == 0 and msg.epoch > open_epoch:
            new[key] = Held(rec.offset, msg.epoch)
            continue
        allowed.append(rec)
    return allowed, new


def open_epoch_of(next_epochs: Iterable[int | None], open_epoch: int) -> int:
    """The open epoch, given each partition's next first-load epoch (None: none left): the lowest of them, never
    below ``open_epoch``; with none left anywhere, ``open_epoch`` stays (no epoch is pending)."""
    pending = [e for e in next_epochs if e is not None]
    return max(open_epoch, min(pending)) if pending else open_epoch


class EpochGate:
    """Holds partitions of the prompts topic at epoch boundaries; see the module docstring.

    ``next_first_load(tp, offset)`` returns the epoch of the first record with ``attempt == 0`` at or after
    ``offset`` in ``tp`` (None when there is none); ``partitions()`` every partition of the prompts topic as
    ``(topic, partition)`` pairs; ``source`` (the producer's :class:`~stream_rl.transport.edge.Source`) says where
    reading stands: its assignment, positions, the group's committed offsets and high-water marks."""

    def __init__(self, source, partitions: Callable[[], list], next_first_load: Callable[[object, int], int | None],
                 check_every_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.source = source
        self.partitions = partitions
        self.next_first_load = next_first_load
        self.check_every_s = check_every_s
        self.clock = clock
        self.open_epoch = 0
        self.held: dict = {}  # (topic, partition) -> Held
        self.holds = 0  # partitions held so far (metrics, tests)
        self._checked_at = float("-inf")
        self._finishing_at, self._finishing = float("-inf"), False

    def admit(self, records: Sequence) -> list:
        """The records that may be generated now; holds (seeks back, lists in ``held``) the partitions that may
        not."""
        self._drop_revoked()
        allowed, new = split_by_epoch(records, self.open_epoch, self.held)
        if new:
            for (topic, partition), hold in new.items():
                self.source.seek(topic, partition, hold.offset)
                self.held[(topic, partition)] = hold
                self.holds += 1
            self._checked_at = float("-inf")  # the epoch may be open already: look now
        self.tick()
        return allowed

    def tick(self) -> None:
        """While holding, re-read where every partition stands (at most every ``check_every_s``) and release the
        partitions whose epoch opened."""
        if not self.held or self.clock() - self._checked_at < self.check_every_s:
            return
        self._checked_at = self.clock()
        if self._own_work_left():
            return  # a partition of ours still has records to take: the epoch cannot have opened (no reads)
        self.open_epoch = open_epoch_of(self._next_epochs(), self.open_epoch)
        opened = [tp for tp, hold in self.held.items() if hold.epoch <= self.open_epoch]
        if opened:
            log.info("epoch %d open: every partition is past the epochs below it", self.open_epoch)
            for tp in opened:
                del self.held[tp]  # the source resumes what is no longer held at its next poll

    def finishing(self) -> bool:
        """True while a partition of another producer is idle at the open epoch (its next first-load is of a later
        epoch, or there is none left): its owner contributes nothing until this producer's partitions finish, so
        this producer's backpressure, which assumes every producer feeds its share, must not stop it. Re-read at
        most every ``check_every_s``."""
        now = self.clock()
        if now - self._finishing_at >= self.check_every_s:
            self._finishing_at = now
            assigned = self.source.assignment()
            parts = self.partitions()
            if all(tp in assigned for tp in parts):  # one producer owns them all: nobody else waits
                self._finishing = False
                return False
            nexts = self._next_epochs(parts)
            self.open_epoch = open_epoch_of(nexts, self.open_epoch)
            self._finishing = any(tp not in assigned and (e is None or e > self.open_epoch)
                                  for tp, e in zip(parts, nexts))
        return self._finishing

    def _next_epochs(self, partitions: list | None = None) -> list[int | None]:
        assigned = self.source.assignment()
        out = []
        for tp in self.partitions() if partitions is None else partitions:
            if tp in self.held:
                out.append(self.held[tp].epoch)
                continue
            if tp in assigned:
                start = self.source.position(*tp)
            else:
                start = self.source.committed(*tp, timeout_s=10.0)
            out.append(self.next_first_load(tp, start or 0))
        return out

    def _own_work_left(self) -> bool:
        """Whether a partition assigned here and not held still has records beyond this producer's position (the
        consumer's high-water mark from its last fetch: no request). Such a record is either of the open epoch
        (so it is not over) or becomes held when polled, so looking further now cannot open an epoch."""
        for tp in self.source.assignment():
            if tp in self.held:
                continue
            highwater = self.source.highwater(*tp)
            if highwater is not None and self.source.position(*tp) < highwater:
                return True
        return False

    def _drop_revoked(self) -> None:
        assigned = self.source.assignment()
        for tp in [tp for tp in self.held if tp not in assigned]:
            del self.held[tp]  # its new owner reads it from the committed offset (the held record) and gates it


def first_load_epoch(reader, decode: Callable[[bytes], object], scan_limit: int = 256
                     ) -> Callable[[object, int], int | None]:
    """``next_first_load`` for :class:`EpochGate`, reading with a group-less ``reader`` (a
    :class:`~stream_rl.transport.reader.Reader`): the epoch of the first decodable record with ``attempt == 0`` at
    or after ``offset``; None when the partition ends first. When ``scan_limit`` records were all re-queues, the
    lowest epoch among them (pending: the gate waits for them to be taken, which they always are, rather than look
    further)."""

    def next_first_load(tp, offset: int) -> int | None:
        lowest, seen = None, 0
        for rec in reader.read_range(tp, offset, scan_limit):
            seen += 1
            value = rec.value
            if value is None:
                continue  # unreadable or null: whoever consumes it dead-letters it
            try:
                msg = decode(value)
            except Exception:  # noqa: BLE001 - an invalid record is dead-lettered by the group's consumer
                continue
            if msg.attempt == 0:
                return msg.epoch
            lowest = msg.epoch if lowest is None else min(lowest, msg.epoch)
        return lowest if seen >= scan_limit else None

    return next_first_load
