"""Folding the alerts topic into the alerts open now (for ``stream-rl status``), and reading a run directory's
own record of its alerts (for ``stream-rl report``).

Consumes: a sequence of ``Alert`` messages (or items with the message in ``.value``, e.g. transport ``Consumed``
records, or decoded records of any kind, of which non-alerts are skipped), in topic order; or a run directory:
``run_dir/alerts/*.jsonl`` (one transition per line, :mod:`stream_rl.alerts.monitor`), else the
``alert NAME firing|resolved (action A) on ROLE INSTANCE: MESSAGE`` lines of ``run_dir/logs/*.log``.
Produces: the alerts firing now: for each ``(instance_id, name)``, the latest transition, kept when it is
``firing``; sorted by ``created_at``. :func:`run_alerts`: every transition the run recorded, oldest first.
Guarantees: "latest" is by ``created_at`` (one process stamps both transitions of a pair with its own clock),
ties broken by position in the sequence; :func:`open_alerts` is pure, no I/O. :func:`run_alerts` skips lines it
cannot read (a crash can tear the last one) and counts them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from pathlib import Path

from schemas import Alert

_FIELDS = {f.name for f in dataclasses.fields(Alert)}
_LOG_LINE = re.compile(r"alert (?P<name>[a-z_]+) (?P<state>firing|resolved) \(action (?P<action>[a-z]+)\) on "
                       r"(?P<role>[a-z]+) (?P<instance_id>\S+): (?P<message>.+)$")


def open_alerts(records: Iterable) -> list[Alert]:
    """The alerts whose latest transition per ``(instance_id, name)`` is ``firing``, oldest first."""
    latest: dict[tuple[str, str], tuple[float, int, Alert]] = {}
    for position, record in enumerate(records):
        alert = record if isinstance(record, Alert) else getattr(record, "value", None)
        if not isinstance(alert, Alert):
            continue
        key = (alert.instance_id, alert.name)
        rank = (alert.created_at, position)
        if key not in latest or rank >= latest[key][:2]:
            latest[key] = (*rank, alert)
    firing = [entry for entry in latest.values() if entry[2].state == "firing"]
    return [alert for *_, alert in sorted(firing, key=lambda e: (e[0], e[1]))]


def run_alerts(run_dir: Path | str) -> tuple[list[Alert], int]:
    """(every alert transition a run recorded, oldest first; unreadable lines): from ``run_dir/alerts/*.jsonl``,
    or, for a run without those files, from the alert lines of ``run_dir/logs/*.log`` (times: line order)."""
    run_dir = Path(run_dir)
    found, bad = [], 0
    for path in sorted((run_dir / "alerts").glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                data = json.loads(line)
                found.append(Alert(**{k: v for k, v in data.items() if k in _FIELDS}))
            except (ValueError, TypeError):
                bad += line.strip() != ""
    if not found:
        found = _from_logs(run_dir / "logs")
    return sorted(found, key=lambda a: a.created_at), bad


def _from_logs(logs: Path) -> list[Alert]:
    out = []
    for path in sorted(logs.glob("*.log")):
        for position, line in enumerate(path.read_text(errors="replace").splitlines()):
            match = _LOG_LINE.search(line)
            if match:
                out.append(Alert(**match.groupdict(), created_at=float(position)))
    return out
