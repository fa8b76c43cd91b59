"""The background reporters of a role process: the heartbeat thread and, for a consumer, the lag thread.

Consumes: the telemetry config, the role, its :class:`~stream_rl.transport.client.Transport`, a
:class:`~stream_rl.telemetry.exporter.RoleExporter` (their results go into its health state and metrics), a
callable returning the current :class:`~stream_rl.telemetry.heartbeat.Beat`, and for lag the role's consumer
group and topics; from the loop's thread, the next offsets it has read and the partitions it is assigned.
Produces: a :class:`~stream_rl.telemetry.heartbeat.HeartbeatPublisher` sending through a producer of its own
(``transport.without_spans()``: same instance id, no spans), whose acknowledgements mark the broker reachable
and whose failures mark it unreachable (``stream_rl_errors_total{type="HeartbeatFailed"}``); and a
:class:`~stream_rl.telemetry.lag.LagMonitor` (only with a group and topics) whose measurements set
``stream_rl_consumer_lag_records`` / ``stream_rl_consumer_position_lag_records`` and whose failures are logged
and counted (``LagFailed``).
Guarantees: the loop never waits on either thread; :meth:`lag_gauges` reads the latest measurement
(``lag/total``, ``lag/position_total``) without blocking; ``close`` stops the lag thread, then the heartbeat
thread (which sends a last heartbeat in state ``stopping``); it is idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from stream_rl.telemetry.config import TelemetryConfig
from stream_rl.telemetry.exporter import RoleExporter
from stream_rl.telemetry.heartbeat import Beat, HeartbeatPublisher
from stream_rl.telemetry.lag import Key, LagMonitor

log = logging.getLogger(__name__)


class Reporters:
    """Starts and owns the heartbeat and lag threads of one role process."""

    def __init__(self, tcfg: TelemetryConfig, role: str, transport, exporter: RoleExporter,
                 snapshot: Callable[[], Beat], *, group: str | None = None, topics: Sequence[str] = ()):
        self.exporter, self.lag_interval_s = exporter, tcfg.lag_interval_s
        self.group = group
        self.heartbeat: HeartbeatPublisher | None = HeartbeatPublisher(
            transport.without_spans().sink(), transport.names.status, role, transport.instance_id,
            tcfg.heartbeat_interval_s, snapshot, exporter.health.broker_ok, self._heartbeat_failed).start()
        self.lag: LagMonitor | None = None
        if group is not None and topics:
            self.lag = LagMonitor(transport, group, topics, tcfg.lag_interval_s, self._lag_measured,
                                  self._lag_failed).start()

    # -- from the loop's thread ------------------------------------------------------------------------------------

    def read_up_to(self, next_offsets: Mapping[Key, int]) -> None:
        """The next offsets this process reads, per partition (for the position lag)."""
        if self.lag is not None:
            self.lag.positions.update(next_offsets)

    def assigned(self, partitions: frozenset[Key]) -> None:
        """The partitions this process is assigned now: the lag covers these only."""
        if self.lag is not None:
            self.lag.assigned = partitions

    @property
    def lag_measured_at(self) -> float | None:
        """Unix time of the latest lag measurement (None: none yet, or no lag thread)."""
        return self.lag.measured_at if self.lag is not None else None

    def lag_gauges(self) -> dict[str, float]:
        """``lag/total`` and ``lag/position_total`` of the latest measurement (empty before the first one)."""
        if self.lag_measured_at is None:
            return {}
        return {"lag/total": float(self.lag.total), "lag/position_total": float(self.lag.position_total)}

    # -- from the threads ------------------------------------------------------------------------------------------

    def _heartbeat_failed(self, exc: BaseException) -> None:
        self.exporter.health.broker_failed(f"{type(exc).__name__}: {exc}")
        self.exporter.metrics.add_error("HeartbeatFailed")

    def _lag_measured(self, lag: dict, position_lag: dict) -> None:
        self.exporter.metrics.set_lag(self.group or "", lag)
        self.exporter.metrics.set_lag(self.group or "", position_lag, position=True)

    def _lag_failed(self, exc: BaseException) -> None:
        log.warning("lag measurement failed (retried in %gs): %r", self.lag_interval_s, exc)
        self.exporter.metrics.add_error("LagFailed")

    def close(self) -> None:
        """Stop the lag thread, then the heartbeat thread after its last heartbeat (idempotent)."""
        for part in (self.lag, self.heartbeat):
            if part is not None:
                part.close()
        self.lag = self.heartbeat = None
