"""The one telemetry object a role loop uses: metrics, health endpoint, heartbeats, lag and alerts together.

Consumes: the root config, the role name, the role's :class:`~stream_rl.transport.client.Transport`, its consumer
group and topics; at run time the calls of the loop (``tick``, ``tokens``, ``observe_seconds``, ...) and of the
transport edge it is attached to (``records_in``, ``records_out``, ``dead_lettered``).
Produces: :class:`~stream_rl.telemetry.metrics.RoleMetrics` series, the HTTP endpoint (``/healthz``, ``/readyz``,
``/metrics``) recorded in ``run_dir/endpoints/<instance_id>.json``, heartbeats on the status topic, lag gauges, and
alert observations (``stream_rl.alerts.AlertMonitor``: records on the alerts topic, a log line, an action).
Guarantees:
- The loop's calls are cheap (counter adds, a clock read); gauges for alerts (RSS, GPU memory, dead letters,
  step) are sampled at most once per second inside ``tick``; heartbeats and lag run on daemon threads.
- Lag: ``lag/total`` (high-water mark - committed offset) and ``lag/position_total`` (high-water mark - the next
  offset this process reads) go into heartbeats; alerts judge ``lag/position_total`` only, once per new lag
  measurement (the trainer commits only at checkpoints, so its committed lag says nothing about keeping up).
- ``close`` also removes this process's ``run_dir/endpoints/<instance_id>.json``.
- Alert actions: ``paused`` is true while a ``pause`` alert fires (the loop stops consuming, keeps ticking);
  ``check_stop`` raises :class:`~stream_rl.alerts.monitor.AlertStop` while a ``stop`` alert fires. The trainer
  calls :meth:`step_done` right after its optimizer step and before publishing weights.
- Restarts (``stream_rl_restarts_total``): a trainer resuming from a checkpoint (``restart()``), and every consumer
  group rebalance that hands this process a different set of partitions after its first assignment.
- ``close`` sends a last heartbeat (state ``stopping``), exports the metrics once more and stops the threads.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stream_rl.telemetry.health import HealthServer, HealthState
from stream_rl.telemetry.heartbeat import Beat, HeartbeatPublisher
from stream_rl.telemetry.lag import LagMonitor
from stream_rl.telemetry.metrics import RoleMetrics, gpu_memory_bytes, process_rss_bytes

log = logging.getLogger(__name__)

STEP_ALERT_KEYS = ("loss/total", "optim/grad_norm", "kl/ref_mean", "reward/mean", "mismatch/logp_abs_diff")
GAUGE_PERIOD_S = 1.0
LAG_KEYS = ("lag/total", "lag/position_total")


class RoleTelemetry:
    """Telemetry of one role process (see the module docstring). Use as a context manager or call ``close``."""

    def __init__(self, cfg, role: str, transport, *, group: str | None = None, topics: Sequence[str] = ()):
        from stream_rl.tracing import Tracing

        tcfg = cfg.telemetry
        self.cfg, self.role, self.instance_id = cfg, role, transport.instance_id
        self.metrics = RoleMetrics(tcfg, role, self.instance_id, Path(cfg.run_dir))
        self.health = HealthState()
        self.counts = {"records_in": 0, "records_out": 0, "tokens": 0}
        self.dead_letters = 0
        self.version, self.step = -1, 0
        self.step_metrics: dict[str, Any] = {}
        self.gauges: dict[str, float] = {}
        self.monitor = None
        self.open_alerts: tuple[str, ...] = ()
        self.state = "starting"
        self._assigned: frozenset | None = None
        self._source = None
        self._last_gauges = 0.0
        self._lag_observed_at: float | None = None
        self.server = None
        if tcfg.http:
            self.server = HealthServer(self.health, tcfg.http_host, tcfg.http_port,
                                       liveness_timeout_s=tcfg.liveness_timeout_s,
                                       broker_timeout_s=2 * tcfg.heartbeat_interval_s + 5.0,
                                       metrics_text=self.metrics.prometheus_text)
            self.server.record(Path(cfg.run_dir) / "endpoints", role, self.instance_id)
        quiet = copy.copy(transport)  # heartbeats: own producer, same instance id, no spans
        quiet.tracing = Tracing(f"{transport.service}-telemetry")
        self.heartbeat = HeartbeatPublisher(quiet.sink(), transport.names.status, role, self.instance_id,
                                            tcfg.heartbeat_interval_s, self._beat, self.health.broker_ok,
                                            self._heartbeat_failed).start()
        self.lag = None
        if group is not None and topics:
            self.lag = LagMonitor(transport, group, topics, tcfg.lag_interval_s, self._lag_measured,
                                  self._lag_failed).start()
        self.names = transport.names

    # -- wiring ---------------------------------------------------------------------------------------------------

    def attach(self, source=None, sink=None) -> RoleTelemetry:
        """Count the edge's records; with ``sink``, alerts are published through it (from the loop's thread)."""
        if source is not None:
            source.observer = self
            self._source = source
        if sink is not None:
            sink.observer = self
            if self.cfg.alerts.enabled:
                from stream_rl.alerts.monitor import AlertMonitor

                self.monitor = AlertMonitor.for_role(self.cfg, self.role, self.instance_id, sink, self.names.alerts)
        return self

    # edge observer protocol (called by Source.poll / Sink.send_raw / Source.dead_letter)
    def records_in(self, topic: str, n: int, next_offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        self.counts["records_in"] += n
        self.metrics.add_records_in(topic, n)
        if self.lag is not None and next_offsets:
            self.lag.positions.update(next_offsets)

    def records_out(self, topic: str, n: int = 1) -> None:
        self.counts["records_out"] += n
        self.metrics.add_records_out(topic, n)

    def dead_lettered(self, topic: str, error_type: str) -> None:
        self.dead_letters += 1
        self.metrics.add_dead_letter(topic)
        self.metrics.add_error(error_type)

    # -- the loop's calls -----------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Once per loop iteration: liveness; at most once a second: assignment, gauges and alert observation."""
        self.health.tick()
        now = time.monotonic()
        if now - self._last_gauges < GAUGE_PERIOD_S:
            return
        self._last_gauges = now
        self._track_assignment()
        self.gauges = self._sample_gauges()
        self._observe_alerts(self._alert_gauges())
        self._update_state()

    def tokens(self, n: int) -> None:
        self.counts["tokens"] += int(n)
        self.metrics.add_tokens(int(n))

    def observe_seconds(self, stage: str, seconds: float) -> None:
        self.metrics.observe_seconds(stage, seconds)

    def observe_staleness(self, versions_behind: Iterable[int]) -> None:
        self.metrics.observe_staleness(versions_behind)

    def error(self, error_type: str, n: int = 1) -> None:
        self.metrics.add_error(error_type, n)

    def restart(self) -> None:
        self.metrics.add_restart()

    def set_version(self, version: int) -> None:
        self.version = int(version)
        self.metrics.set_policy_version(self.version)
        self.health.update(version=self.version)

    def set_ready(self, model_loaded: bool = True, version: int | None = None) -> None:
        """The model is loaded (and, with ``version``, the weights version is known)."""
        if version is not None:
            self.set_version(version)
        self.health.update(model_loaded=model_loaded)
        self._update_state()

    def set_step(self, step: int) -> None:
        self.step = int(step)

    def step_done(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Trainer: after the optimizer step (before publishing weights): gauges + the step's alert observation.
        The step's metrics are exported by :meth:`row_written`, which follows for every step.

        Raises AlertStop while a ``stop`` alert fires (the caller writes the row, checkpoints and exits)."""
        self.step = int(step)
        values = {k: metrics[k] for k in STEP_ALERT_KEYS if isinstance(metrics.get(k), (int, float))}
        self.gauges = self._sample_gauges()
        self._last_gauges = time.monotonic()
        self._observe_alerts({**self._alert_gauges(), **values})
        self.check_stop()

    def row_written(self, row: Mapping[str, Any]) -> None:
        """Trainer: every key of the metrics.jsonl row becomes ``stream_rl_trainer_metric{name}``."""
        self.step_metrics = dict(row)
        self.metrics.set_step_metrics(self.step, {k: v for k, v in row.items() if k not in ("step", "time")})

    @property
    def paused(self) -> bool:
        return self.monitor is not None and self.monitor.paused

    def check_stop(self) -> None:
        if self.monitor is not None:
            self.monitor.check_stop()

    # -- internals ------------------------------------------------------------------------------------------------

    def _track_assignment(self) -> None:
        if self._source is None:
            return
        current = frozenset((tp.topic, tp.partition) for tp in self._source.consumer.assignment())
        if not current:
            return
        if self._assigned is not None and current != self._assigned:
            self.metrics.add_restart()  # a rebalance changed what this process reads
        self._assigned = current
        if self.lag is not None:
            self.lag.assigned = current

    def _sample_gauges(self) -> dict[str, float]:
        gauges = {"process/rss_bytes": float(process_rss_bytes()), "dlq/total": float(self.dead_letters),
                  "step": float(self.step)}
        gpu = gpu_memory_bytes()
        if gpu:
            gauges["gpu/allocated_bytes"] = float(sum(a for a, _ in gpu.values()))
        if self.lag is not None and self.lag.measured_at is not None:
            gauges["lag/total"] = float(self.lag.total)
            gauges["lag/position_total"] = float(self.lag.position_total)
        return gauges

    def _alert_gauges(self) -> dict[str, float]:
        """The gauges for an alert observation: the lag only when it was measured anew since the last one (each
        presence is one sample, and a producer's lag is judged by its growth between measurements)."""
        gauges = {k: v for k, v in self.gauges.items() if k not in LAG_KEYS}
        measured = self.lag.measured_at if self.lag is not None else None
        if measured is not None and measured != self._lag_observed_at:
            self._lag_observed_at = measured
            gauges.update({k: self.gauges[k] for k in LAG_KEYS if k in self.gauges})
        return gauges

    def _observe_alerts(self, values: Mapping[str, float]) -> None:
        if self.monitor is None:
            return
        before = set(self.open_alerts)
        self.monitor.observe(time.time(), values)
        self.open_alerts = tuple(self.monitor.firing)
        changed = before ^ set(self.open_alerts)
        if changed:
            self.metrics.set_alerts({name: name in self.open_alerts for name in changed})
        self._update_state()

    def _update_state(self) -> None:
        if self.state == "stopping":
            return
        ready = self.health.snapshot().model_loaded
        self.state = "paused" if self.paused else "ready" if ready else "starting"

    def _beat(self) -> Beat:
        metrics = {**self.step_metrics, **self.gauges, "loop/tick_age_s": self._tick_age()}
        return Beat(time=time.time(), state=self.state, policy_version=self.version, step=self.step,
                    counts=dict(self.counts), metrics=metrics, open_alerts=self.open_alerts)

    def _tick_age(self) -> float:
        last = self.health.snapshot().last_tick
        return time.monotonic() - last if last is not None else -1.0

    def _heartbeat_failed(self, exc: BaseException) -> None:
        self.health.broker_failed(f"{type(exc).__name__}: {exc}")
        self.metrics.add_error("HeartbeatFailed")

    def _lag_measured(self, lag: dict, position_lag: dict) -> None:
        group = self.lag.group if self.lag is not None else ""
        self.metrics.set_lag(group, lag)
        self.metrics.set_lag(group, position_lag, position=True)

    def _lag_failed(self, exc: BaseException) -> None:
        log.warning("lag measurement failed (retried in %gs): %r", self.cfg.telemetry.lag_interval_s, exc)
        self.metrics.add_error("LagFailed")

    def close(self) -> None:
        """Last heartbeat, final metrics export, threads and HTTP server stopped (idempotent)."""
        if self.state == "stopping" and self.heartbeat is None:
            return
        self.state = "stopping"
        for part in (self.lag, self.heartbeat, self.server, self.metrics):
            if part is not None:
                part.close()
        self.heartbeat = self.lag = self.server = None

    def __enter__(self) -> RoleTelemetry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
