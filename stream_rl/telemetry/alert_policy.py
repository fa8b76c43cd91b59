"""The alert policy of a role process: which values each alert observation sees, and what the loop must do.

Consumes: the role's gauges (sampled at most once a second by :class:`~stream_rl.telemetry.role.RoleTelemetry`),
the time of the latest lag measurement, the per-step values a role hands over after a step (the trainer's, named
in ``consumers.trainer.telemetry_names``), and an optional :class:`~stream_rl.alerts.monitor.AlertMonitor`
(armed once the role has a sink to publish alerts through; ``None``: alerts are off and nothing ever fires).
Produces: one observation per call to :meth:`AlertPolicy.observe` (the monitor publishes, records and logs the
transitions), the names of the alerts firing now (``open_alerts``, for heartbeats) and the alerts whose firing
state changed (for ``stream_rl_alerts_firing``).
Guarantees::

    observation(gauges) = gauges without lag/total, lag/position_total
                        + those two, only when the lag was measured anew since the previous observation
    paused              = an alert with action "pause" (and none with "stop") fires
    check_stop()        raises AlertStop while an alert with action "stop" fires

Each presence of a lag value is one sample (a producer's lag is judged by its growth between measurements), so the
same measurement is never observed twice. Nothing here touches a broker except through the monitor's sink.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

LAG_KEYS = ("lag/total", "lag/position_total")


class AlertPolicy:
    """Feeds observations to an alert monitor and answers the loop's pause / stop questions."""

    def __init__(self, monitor=None) -> None:
        self.monitor = monitor  # an AlertMonitor, or None while (or when) alerts are off
        self.open_alerts: tuple[str, ...] = ()
        self._lag_observed_at: float | None = None

    def observation(self, gauges: Mapping[str, float], lag_measured_at: float | None) -> dict[str, float]:
        """The gauges for one observation: the lag keys only when ``lag_measured_at`` is new (see the module)."""
        values = {k: v for k, v in gauges.items() if k not in LAG_KEYS}
        if lag_measured_at is not None and lag_measured_at != self._lag_observed_at:
            self._lag_observed_at = lag_measured_at
            values.update({k: gauges[k] for k in LAG_KEYS if k in gauges})
        return values

    def observe(self, values: Mapping[str, float], now: float | None = None) -> dict[str, bool]:
        """One observation (``now`` defaults to Unix time); returns ``{alert name: firing}`` of the alerts whose
        firing state changed (empty without a monitor)."""
        if self.monitor is None:
            return {}
        before = set(self.open_alerts)
        self.monitor.observe(time.time() if now is None else now, values)
        self.open_alerts = tuple(self.monitor.firing)
        return {name: name in self.open_alerts for name in before ^ set(self.open_alerts)}

    @property
    def paused(self) -> bool:
        """True while the strongest firing action is ``pause``: the loop stops consuming, keeps ticking."""
        return self.monitor is not None and self.monitor.paused

    def check_stop(self) -> None:
        """Raise :class:`~stream_rl.alerts.monitor.AlertStop` while an alert with action ``stop`` fires."""
        if self.monitor is not None:
            self.monitor.check_stop()
