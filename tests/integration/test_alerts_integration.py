"""Alerts end to end on the real local broker: memory growth from real allocations fires on the alerts topic, pauses
and resolves. The trainer's alert actions (a NaN loss and a ``stop`` alert end it with code 3; a ``pause`` alert
stops consuming) run on the in-process bus: tests/unit/test_trainer_loop_alerts.py."""

from __future__ import annotations

import logging
import time

import pytest
from support.topics import read_values

from stream_rl.alerts.monitor import AlertMonitor
from stream_rl.telemetry.metrics import process_rss_bytes
from stream_rl.transport.client import Transport

pytestmark = pytest.mark.broker

MIB = 1 << 20


def read_alerts(transport) -> list:
    return read_values(transport, transport.names.alerts, "alert")


def sample_rss(monitor: AlertMonitor, seconds: float, allocate_mib: int = 0, held: list | None = None,
               until: str | None = None, max_allocations: int = 25) -> list:
    """Observe this process's real RSS every 0.1 s for ``seconds`` (or until a transition to state ``until``),
    first allocating (and touching) ``allocate_mib`` MiB each time, at most ``max_allocations`` times."""
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (until and any(a.state == until for a in out)):
        if allocate_mib and len(held) < max_allocations:
            held.append(b"\x01" * (allocate_mib * MIB))  # written, so resident
        out += monitor.observe(time.monotonic(), {"process/rss_bytes": process_rss_bytes()})
        time.sleep(0.1)
    return out


def test_memory_growth_from_real_allocations_fires_pauses_and_resolves(make_config, caplog):
    cfg = make_config(**{"alerts.memory_growth.window_s": 1.0, "alerts.memory_growth.min_span_s": 0.5,
                         "alerts.memory_growth.min_samples": 5,
                         "alerts.memory_growth.max_slope_bytes_per_s": 10.0 * MIB,
                         "alerts.memory_growth.action": "pause"})
    t = Transport(cfg, "test")
    t.ensure_topics()
    monitor = AlertMonitor.for_role(cfg, "scorer", "scorer-mem01", t.sink(), t.names.alerts,
                                    logging.getLogger("test.alerts.mem"))
    held: list[bytes] = []
    with caplog.at_level(logging.INFO, logger="test.alerts.mem"):
        assert sample_rss(monitor, 1.5) == []  # steady RSS: nothing
        fired = sample_rss(monitor, 10, allocate_mib=8, held=held, until="firing")  # ~80 MiB/s, always higher
        assert [(a.name, a.state) for a in fired] == [("memory_growth", "firing")]
        assert monitor.paused and monitor.action == "pause"
        held.clear()  # freed: RSS falls, then stays flat
        resolved = sample_rss(monitor, 15, until="resolved")
        assert [(a.name, a.state) for a in resolved] == [("memory_growth", "resolved")]
        assert not monitor.paused
    on_topic = read_alerts(t)
    assert [(a.name, a.state, a.action, a.instance_id) for a in on_topic] == [
        ("memory_growth", "firing", "pause", "scorer-mem01"), ("memory_growth", "resolved", "pause", "scorer-mem01")]
    assert on_topic[0].value > 10.0 * MIB and on_topic[0].threshold == 10.0 * MIB
    assert "process/rss_bytes slope" in on_topic[0].message
    assert any(r.levelno == logging.WARNING and "memory_growth firing" in r.getMessage() for r in caplog.records)
