"""Heartbeats: a role process saying it is alive, on the run's status topic, every ``heartbeat_interval_s``.

Consumes: a callable that snapshots the process's counters (records in/out, tokens, step, version, state, metrics,
open alerts), a sink of its own (its own Kafka producer, no tracing spans) and the health state.
Produces: ``schemas.Heartbeat`` records on ``names.status`` keyed by ``instance_id`` from a daemon thread, and the
broker-reachability fact readiness needs: a heartbeat acknowledged by the broker marks it reachable, one that is not
acknowledged within ``flush_timeout_s`` marks it unreachable with the error.
Guarantees::

    rates[k] = (count_k(now) - count_k(previous beat)) / (now - previous beat)     for k in records_in, records_out,
                                                                                    tokens (0.0 on the first beat)
    metrics  = the finite entries of the snapshot's metrics (NaN/Inf are left out, as the schema requires)

The loop never waits on a heartbeat; a failed one is logged (once per outage) and the next is tried on schedule.
No prompt or response text is ever part of a heartbeat (only numbers, ids and alert names).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from schemas import Heartbeat

log = logging.getLogger(__name__)

RATE_KEYS = ("records_in", "records_out", "tokens")


@dataclass(frozen=True)
class Beat:
    """A snapshot of what one heartbeat reports (counts are cumulative since the process started)."""

    time: float
    state: str
    policy_version: int
    step: int
    counts: Mapping[str, float]
    metrics: Mapping[str, float] = field(default_factory=dict)
    open_alerts: tuple[str, ...] = ()


def rates(previous: Beat | None, current: Beat) -> dict[str, float]:
    """Per-second rates of the cumulative counts between two beats (0.0 without a previous beat)."""
    if previous is None or current.time <= previous.time:
        return {k: 0.0 for k in RATE_KEYS}
    span = current.time - previous.time
    return {k: max(0.0, float(current.counts.get(k, 0)) - float(previous.counts.get(k, 0))) / span
            for k in RATE_KEYS}


def finite_metrics(metrics: Mapping[str, object]) -> dict[str, float]:
    """The entries that are finite numbers (bools and None dropped)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def make_heartbeat(role: str, instance_id: str, beat: Beat, previous: Beat | None, interval_s: float) -> Heartbeat:
    """The Heartbeat message of ``beat`` (pure apart from the host name and pid)."""
    return Heartbeat(role=role, instance_id=instance_id, host=socket.gethostname() or "unknown", pid=os.getpid(),
                     state=beat.state, policy_version=int(beat.policy_version), step=max(0, int(beat.step)),
                     rates=rates(previous, beat), metrics=finite_metrics(beat.metrics),
                     open_alerts=list(beat.open_alerts), interval_s=float(interval_s), created_at=beat.time)


class HeartbeatPublisher:
    """Sends a heartbeat every ``interval_s`` on a daemon thread; ``close()`` sends a last one ("stopping")."""

    def __init__(self, sink, topic: str, role: str, instance_id: str, interval_s: float,
                 snapshot: Callable[[], Beat], on_ack: Callable[[], None],
                 on_failure: Callable[[BaseException], None]):
        self.sink, self.topic, self.role, self.instance_id = sink, topic, role, instance_id
        self.interval_s = interval_s
        self.flush_timeout_s = max(1.0, min(interval_s, 5.0))
        self.snapshot, self.on_ack, self.on_failure = snapshot, on_ack, on_failure
        self.sent = 0
        self._previous: Beat | None = None
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{instance_id}", daemon=True)

    def start(self) -> HeartbeatPublisher:
        self._thread.start()
        return self

    def beat(self, state: str | None = None) -> bool:
        """Send one heartbeat and wait for the broker's ack; True when acknowledged."""
        current = self.snapshot()
        if state is not None:
            current = replace(current, state=state)
        message = make_heartbeat(self.role, self.instance_id, current, self._previous, self.interval_s)
        try:
            self.sink.send(self.topic, message, key=self.instance_id)
            self.sink.flush(self.flush_timeout_s)
        except Exception as exc:  # broker down or slow: readiness says so; the loop carries on
            if not self._failing:
                log.warning("heartbeat to %s not acknowledged (broker unreachable?): %r", self.topic, exc)
            self._failing = True
            self.on_failure(exc)
            return False
        if self._failing:
            log.info("heartbeats acknowledged again")
        self._failing = False
        self._previous = current
        self.sent += 1
        self.on_ack()
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.beat()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def close(self) -> None:
        """Stop the thread, send a last heartbeat in state ``stopping`` (best effort) and close the producer."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.flush_timeout_s + 5.0)
        if not self._failing:
            self.beat("stopping")
        try:
            self.sink.close(timeout_s=self.flush_timeout_s)
        except Exception as exc:  # unsent heartbeats of a broker that went away: nothing left to deliver them to
            log.warning("heartbeat producer closed with heartbeats unsent: %r", exc)
