"""Consumer lag per partition: high-water mark minus the group's committed offset (and minus this process's position).

Consumes: a transport (for a group-less reader and an admin client), the consumer group and topics of a role, the
partitions this process is assigned (a snapshot the loop hands over) and the next offsets it has read.
Produces: ``{(topic, partition): lag}`` twice, committed-based and position-based, every ``lag_interval_s`` on a
daemon thread, pushed to :class:`~stream_rl.telemetry.metrics.RoleMetrics` and kept for heartbeats and alerts.
Guarantees::

    lag(p)          = max(0, highwater(p) - committed(p))      committed missing -> 0 (the log start is assumed 0)
    position_lag(p) = max(0, highwater(p) - next_offset(p))    next_offset missing -> committed(p)

High-water marks come from fetch responses (ListOffsets(latest) is wrong on tansu; see notes): the reader fetches
each partition from the previous mark (first time: the committed offset), so a measurement moves only new records.
The loop never waits on any of this; a failed measurement is logged, counted as an error and retried at the next
interval. The sums over the watched partitions are ``lag/total`` (committed) and ``lag/position_total`` (position);
alerts judge the latter (:mod:`stream_rl.alerts.rules`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

Key = tuple[str, int]


def compute_lag(highwaters: Mapping[Any, int], offsets: Mapping[Any, int | None]) -> dict[Any, int]:
    """``max(0, highwater - offset)`` per partition key (``(topic, partition)`` here, the partition number in
    ``stream-rl status``); a missing or negative offset counts as 0."""
    out = {}
    for key, mark in highwaters.items():
        offset = offsets.get(key)
        out[key] = max(0, int(mark) - (int(offset) if offset is not None and offset >= 0 else 0))
    return out


class LagMonitor:
    """Measures the lag of one consumer group on a daemon thread every ``interval_s``."""

    def __init__(self, transport, group: str, topics: Sequence[str], interval_s: float,
                 on_lag: Callable[[dict[Key, int], dict[Key, int]], None],
                 on_error: Callable[[BaseException], None]):
        self.transport, self.group, self.topics = transport, group, list(topics)
        self.interval_s = interval_s
        self.on_lag, self.on_error = on_lag, on_error
        self.assigned: frozenset[Key] | None = None  # set by the loop's thread; None = every partition
        self.positions: dict[Key, int] = {}  # next offset this process reads, per partition (loop thread writes)
        self.lag: dict[Key, int] = {}
        self.position_lag: dict[Key, int] = {}
        self.measured_at: float | None = None
        self._stop = threading.Event()
        self._reader = self._admin = None
        self._marks: dict[Key, int] = {}
        self._thread = threading.Thread(target=self._run, name=f"lag-{group}", daemon=True)

    def start(self) -> LagMonitor:
        self._thread.start()
        return self

    def measure(self) -> tuple[dict[Key, int], dict[Key, int]]:
        """One measurement: (committed lag, position lag) of the watched partitions."""
        if self._reader is None:
            self._reader, self._admin = self.transport.reader(), self.transport.admin()
        assigned = self.assigned
        tps = [tp for topic in self.topics for tp in self._reader.partitions(topic)
               if assigned is None or tp in assigned]
        if not tps:
            return {}, {}
        committed = self._admin.committed_offsets(self.group)
        start = {**committed, **self._marks}  # fetch only what was added since the last mark
        marks = self._reader.highwaters(tps, start={tp: start.get(tp) for tp in tps})
        self._marks = marks
        positions = {**committed, **{k: v for k, v in dict(self.positions).items() if k in marks}}
        return compute_lag(marks, committed), compute_lag(marks, positions)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.lag, self.position_lag = self.measure()
                self.measured_at = time.time()
                self.on_lag(self.lag, self.position_lag)
            except Exception as exc:  # a telemetry thread must not kill the role: report, reconnect, retry
                self.on_error(exc)
                self._close_clients()
            self._stop.wait(self.interval_s)
        self._close_clients()

    def _close_clients(self) -> None:
        for client in (self._reader, self._admin):
            if client is not None:
                try:
                    client.close()
                except Exception as exc:  # closing a client of a dead broker may fail; nothing to recover
                    log.debug("closing a lag client failed: %r", exc)
        self._reader = self._admin = None

    @property
    def total(self) -> int:
        """Committed lag over the watched partitions (``lag/total``)."""
        return sum(self.lag.values())

    @property
    def position_total(self) -> int:
        """Position lag over the watched partitions (``lag/position_total``): what this process has not read."""
        return sum(self.position_lag.values())

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(15.0)
