"""The one telemetry object a role loop uses: a thin composition of the exporter, the reporters and the alert policy.

Consumes: the root config, the role name, the role's :class:`~stream_rl.transport.client.Transport`, its consumer
group and topics; at run time the calls of the loop (``tick``, ``tokens``, ``observe_seconds``, ...) and of the
transport edge it is attached to (``records_in``, ``records_out``, ``dead_lettered``).
Produces, through its parts:

- :class:`~stream_rl.telemetry.exporter.RoleExporter`: the :class:`~stream_rl.telemetry.metrics.RoleMetrics`
  series, the health state and the HTTP endpoint (``/healthz``, ``/readyz``, ``/metrics``) recorded in
  ``run_dir/endpoints/<instance_id>.json``;
- :class:`~stream_rl.telemetry.reporters.Reporters`: heartbeats on the status topic and lag gauges (daemon threads);
- :class:`~stream_rl.telemetry.alert_policy.AlertPolicy`: alert observations (``stream_rl.alerts.AlertMonitor``:
  records on the alerts topic, a log line, an action) and the loop's pause / stop answers.

What this object itself holds is what heartbeats report: state, version, step, the latest gauges and step row.
Guarantees:
- The loop's calls are cheap (counter adds, a clock read); gauges for alerts (RSS, GPU memory, dead letters,
  step, lag) are sampled at most once per second inside ``tick``; heartbeats and lag run on daemon threads.
- Lag: ``lag/total`` (high-water mark - committed offset) and ``lag/position_total`` (high-water mark - the next
  offset this process reads) go into heartbeats; alerts judge ``lag/position_total`` only, once per new lag
  measurement (the trainer commits only at checkpoints, so its committed lag says nothing about keeping up).
- Alert actions: ``paused`` is true while a ``pause`` alert fires (the loop stops consuming, keeps ticking);
  ``check_stop`` raises :class:`~stream_rl.alerts.monitor.AlertStop` while a ``stop`` alert fires. The trainer
  calls :meth:`RoleTelemetry.step_done` right after its optimizer step and before publishing weights, with the
  step values it chose (``consumers.trainer.telemetry_names``): this layer knows no metric name of a role.
- Restarts (``stream_rl_restarts_total``): a trainer resuming from a checkpoint (``restart()``), and every consumer
  group rebalance that hands this process a different set of partitions after its first assignment.
- ``close`` sends a last heartbeat (state ``stopping``), stops the threads and the HTTP server (removing
  ``run_dir/endpoints/<instance_id>.json``) and exports the metrics once more; it is idempotent.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stream_rl.telemetry.alert_policy import AlertPolicy
from stream_rl.telemetry.exporter import RoleExporter
from stream_rl.telemetry.heartbeat import Beat
from stream_rl.telemetry.reporters import Reporters

GAUGE_PERIOD_S = 1.0


class RoleTelemetry:
    """Telemetry of one role process (see the module docstring). Use as a context manager or call ``close``."""

    def __init__(self, cfg, role: str, transport, *, group: str | None = None, topics: Sequence[str] = ()):
        self.cfg, self.role, self.instance_id, self.names = cfg, role, transport.instance_id, transport.names
        self.exporter = RoleExporter(cfg.telemetry, role, self.instance_id, Path(cfg.run_dir))
        self.alerts = AlertPolicy()
        self.state, self.version, self.step = "starting", -1, 0
        self.step_metrics: dict[str, Any] = {}
        self.gauges: dict[str, float] = {}
        self._assigned: frozenset | None = None
        self._source = None
        self._last_gauges = 0.0
        self.reporters = Reporters(cfg.telemetry, role, transport, self.exporter, self._beat, group=group,
                                   topics=topics)  # last: the heartbeat thread reads the state above

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

                self.alerts.monitor = AlertMonitor.for_role(self.cfg, self.role, self.instance_id, sink,
                                                            self.names.alerts)
        return self

    # edge observer protocol (called by Source.poll / Sink.send_raw / Source.dead_letter)
    def records_in(self, topic: str, n: int, next_offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        self.exporter.records_in(topic, n)
        if next_offsets:
            self.reporters.read_up_to(next_offsets)

    def records_out(self, topic: str, n: int = 1) -> None:
        self.exporter.records_out(topic, n)

    def dead_lettered(self, topic: str, error_type: str) -> None:
        self.exporter.dead_lettered(topic, error_type)

    # -- the loop's calls -----------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Once per loop iteration: liveness; at most once a second: assignment, gauges and alert observation."""
        self.exporter.health.tick()
        now = time.monotonic()
        if now - self._last_gauges < GAUGE_PERIOD_S:
            return
        self._last_gauges = now
        self._track_assignment()
        self._sample_gauges()
        self._judge()

    def tokens(self, n: int) -> None:
        self.exporter.tokens(n)

    def observe_seconds(self, stage: str, seconds: float) -> None:
        self.exporter.metrics.observe_seconds(stage, seconds)

    def observe_staleness(self, versions_behind: Iterable[int]) -> None:
        self.exporter.metrics.observe_staleness(versions_behind)

    def error(self, error_type: str, n: int = 1) -> None:
        self.exporter.metrics.add_error(error_type, n)

    def restart(self) -> None:
        self.exporter.metrics.add_restart()

    def set_version(self, version: int) -> None:
        self.version = int(version)
        self.exporter.set_version(self.version)

    def set_ready(self, model_loaded: bool = True, version: int | None = None) -> None:
        """The model is loaded (and, with ``version``, the weights version is known)."""
        if version is not None:
            self.set_version(version)
        self.exporter.health.update(model_loaded=model_loaded)
        self._update_state()

    def set_step(self, step: int) -> None:
        self.step = int(step)

    def step_done(self, step: int, values: Mapping[str, float]) -> None:
        """After a step (the trainer: its optimizer step, before publishing weights): gauges and one alert
        observation holding the step's ``values`` (the keys the rules judge, chosen by the role).

        Raises AlertStop while a ``stop`` alert fires (the caller writes the row, checkpoints and exits)."""
        self.step = int(step)
        self._sample_gauges()
        self._last_gauges = time.monotonic()
        self._judge(values)
        self.check_stop()

    def row_written(self, row: Mapping[str, Any], exported: Mapping[str, Any]) -> None:
        """The step's row was written: heartbeats carry ``row`` in their metrics; every entry of ``exported``
        becomes ``stream_rl_trainer_metric{name}`` (and the step ``stream_rl_trainer_step``)."""
        self.step_metrics = dict(row)
        self.exporter.metrics.set_step_metrics(self.step, exported)

    @property
    def paused(self) -> bool:
        return self.alerts.paused

    def check_stop(self) -> None:
        self.alerts.check_stop()

    # -- internals ------------------------------------------------------------------------------------------------

    def _track_assignment(self) -> None:
        if self._source is None:
            return
        current = frozenset(self._source.assignment())
        if not current:
            return
        if self._assigned is not None and current != self._assigned:
            self.exporter.metrics.add_restart()  # a rebalance changed what this process reads
        self._assigned = current
        self.reporters.assigned(current)

    def _sample_gauges(self) -> None:
        self.gauges = {**self.exporter.process_gauges(self.step), **self.reporters.lag_gauges()}

    def _judge(self, values: Mapping[str, float] | None = None) -> None:
        """One alert observation: the gauges (lag only when new) plus ``values``; firing changes are exported."""
        observation = self.alerts.observation(self.gauges, self.reporters.lag_measured_at)
        changed = self.alerts.observe({**observation, **(values or {})})
        if changed:
            self.exporter.metrics.set_alerts(changed)
        self._update_state()

    def _update_state(self) -> None:
        if self.state != "stopping":
            self.state = "paused" if self.paused else "ready" if self.exporter.model_loaded else "starting"

    def _beat(self) -> Beat:
        metrics = {**self.step_metrics, **self.gauges, "loop/tick_age_s": self.exporter.tick_age()}
        return Beat(time=time.time(), state=self.state, policy_version=self.version, step=self.step,
                    counts=dict(self.exporter.counts), metrics=metrics, open_alerts=self.alerts.open_alerts)

    def close(self) -> None:
        """Last heartbeat, threads stopped, HTTP server stopped, final metrics export (idempotent)."""
        self.state = "stopping"
        self.reporters.close()
        self.exporter.close()

    def __enter__(self) -> RoleTelemetry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
