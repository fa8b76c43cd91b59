"""The driver's heartbeat: its environment's episodes by outcome, for ``stream-rl status``.

Consumes: the shared sections (``kafka``, ``topics``, ``telemetry``) and, after every group and every half second
while one plays, the driver's :class:`~producers.driver.role.Summary`.
Produces: heartbeats of role ``driver`` on the run's status topic (:class:`~stream_rl.telemetry.role.RoleTelemetry`;
step = groups played) whose metrics are ``env/verifiers:NAME/{ok, failed, timed_out, refilled, abandoned}``
(episodes since the driver started: rewarded, failed other than on a deadline, failed on a deadline, failed and
replaced by another episode of their group, left open by a dead driver and ended as failed), which
``stream-rl status`` shows in its environments table beside the producers'.
Guarantees: only built when a broker is configured (``kafka.bootstrap_servers``: always under ``stream-rl run``);
the driver itself never needs one. ``close()`` sends the last heartbeat (``stopping``).
"""

from __future__ import annotations

from producers.driver.role import Summary
from stream_rl.config.shared import SharedConfig


class DriverHealth:
    def __init__(self, shared: SharedConfig) -> None:
        from stream_rl.telemetry.role import RoleTelemetry
        from stream_rl.transport.client import Transport

        self.telemetry = RoleTelemetry(shared, "driver", Transport(shared, "driver"))
        self.telemetry.set_ready(model_loaded=True)

    def report(self, name: str, summary: Summary) -> None:
        self.telemetry.step_metrics = metrics(name, summary)
        self.telemetry.set_step(summary.groups)
        self.telemetry.tick()

    def close(self) -> None:
        self.telemetry.close()


def metrics(name: str, summary: Summary) -> dict[str, float]:
    """The heartbeat's metrics of ``summary`` (module docstring)."""
    counts = {"ok": summary.rewarded, "failed": summary.failed - summary.timed_out, "timed_out": summary.timed_out,
              "refilled": summary.refilled, "abandoned": summary.abandoned}
    return {f"env/{name}/{key}": float(value) for key, value in counts.items()}
