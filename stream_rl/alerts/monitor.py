"""The alert monitor of one role process: engine transitions -> alerts topic records + log lines; loop actions.

Consumes: an :class:`~stream_rl.alerts.engine.AlertEngine`, the process's transport ``Sink``, the run's alerts
topic (``TopicNames.alerts``) and a logger; ``observe(now, values)`` calls from the role loop.
Produces: one ``Alert`` record per transition on the alerts topic (key = alert name), flushed before
``observe`` returns; the same transition as one JSON line appended to ``run_dir/alerts/<instance_id>.jsonl``
(the run's own record of its alerts, read by ``stream-rl report`` without a broker; :func:`alert_log_path`); and
one log line per transition (WARNING when firing, INFO when resolved) holding the rule name, action, role,
instance and the rule's numeric message, never sample text.
Guarantees: ``paused`` is true while an alert with action ``pause`` (and none with ``stop``) fires;
``check_stop()`` raises :class:`AlertStop` while an alert with action ``stop`` fires, after its record is durable
on the broker. ``log`` alerts change nothing in the loop.

How a role loop uses it (the wiring lives in the loops, owned by the telemetry work)::

    monitor = AlertMonitor.for_role(cfg, "trainer", instance_id, sink, names.alerts)
    ...after each step, before publishing weights derived from it:
    monitor.observe(time.time(), {"loss/total": ..., "optim/grad_norm": ..., "step": state.step, ...})
    if monitor.stop_alert: write the final checkpoint, then monitor.check_stop()    # AlertStop -> exit code 3
    while monitor.paused: keep observing (lag, memory, ...) without polling new records

Observe gauges (step, lag, memory, dlq) at most about once per second: each observation is one sample.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path

from schemas import Alert
from stream_rl.alerts.engine import AlertEngine

EXIT_CODE_STOP = 3
"""Process exit code after an alert with action ``stop``."""


class AlertStop(RuntimeError):
    """An alert with action ``stop`` fired: the process exits with :data:`EXIT_CODE_STOP` after a final
    checkpoint."""

    exit_code = EXIT_CODE_STOP

    def __init__(self, alert: Alert) -> None:
        super().__init__(f"alert {alert.name} (action stop) on {alert.role} {alert.instance_id}: {alert.message}")
        self.alert = alert


ALERTS_DIR = "alerts"
"""Directory under ``run_dir`` holding one ``<instance_id>.jsonl`` of alert transitions per process."""


def alert_log_path(run_dir: Path | str, instance_id: str) -> Path:
    """``run_dir/alerts/<instance_id>.jsonl``: where a process appends its alert transitions."""
    return Path(run_dir) / ALERTS_DIR / f"{instance_id}.jsonl"


class AlertMonitor:
    """Publishes, records and logs an engine's transitions; tells the loop whether to pause or stop."""

    def __init__(self, engine: AlertEngine, sink, topic: str, log: logging.Logger | None = None,
                 record_path: Path | None = None) -> None:
        self.engine, self._sink, self.topic = engine, sink, topic
        self._log = log or logging.getLogger(__name__)
        self.record_path = record_path
        self.published = 0

    @classmethod
    def for_role(cls, cfg, role: str, instance_id: str, sink, topic: str,
                 log: logging.Logger | None = None) -> AlertMonitor:
        """A monitor over ``cfg.alerts`` (``cfg`` is the root config) for one role process, recording its
        transitions under ``cfg.run_dir``."""
        return cls(AlertEngine(cfg.alerts, role, instance_id), sink, topic, log,
                   alert_log_path(cfg.run_dir, instance_id))

    def observe(self, now: float, values: Mapping[str, float]) -> list[Alert]:
        """Feed one observation; publish (and flush) and log every transition; return them."""
        transitions = self.engine.observe(now, values)
        for alert in transitions:
            self._sink.send(self.topic, alert, key=alert.name)
        if transitions:
            self._sink.flush()
            self.published += len(transitions)
            self._record(transitions)
        for alert in transitions:
            level = logging.WARNING if alert.state == "firing" else logging.INFO
            self._log.log(level, "alert %s %s (action %s) on %s %s: %s", alert.name, alert.state, alert.action,
                          alert.role, alert.instance_id, alert.message)
        return transitions

    def _record(self, transitions: list[Alert]) -> None:
        if self.record_path is None:
            return
        self.record_path.parent.mkdir(parents=True, exist_ok=True)
        with self.record_path.open("a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(dataclasses.asdict(a), sort_keys=True) + "\n" for a in transitions)

    @property
    def firing(self) -> list[str]:
        """Names of the alerts firing now (for the heartbeat's ``open_alerts``)."""
        return self.engine.firing

    @property
    def action(self) -> str:
        """Strongest action among firing alerts: ``none`` | ``log`` | ``pause`` | ``stop``."""
        return self.engine.action

    @property
    def paused(self) -> bool:
        """True while the strongest firing action is ``pause``: the loop stops consuming new records."""
        return self.engine.action == "pause"

    @property
    def stop_alert(self) -> Alert | None:
        """The first firing alert with action ``stop``, if any."""
        return next((a for a in self.engine.firing_alerts if a.action == "stop"), None)

    def check_stop(self) -> None:
        """Raise :class:`AlertStop` while an alert with action ``stop`` fires."""
        alert = self.stop_alert
        if alert is not None:
            raise AlertStop(alert)
