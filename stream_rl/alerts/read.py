"""Folding the alerts topic into the alerts open now (for ``stream-rl status``).

Consumes: a sequence of ``Alert`` messages (or items with the message in ``.value``, e.g. transport ``Consumed``
records, or decoded records of any kind, of which non-alerts are skipped), in topic order.
Produces: the alerts firing now: for each ``(instance_id, name)``, the latest transition, kept when it is
``firing``; sorted by ``created_at``.
Guarantees: "latest" is by ``created_at`` (one process stamps both transitions of a pair with its own clock),
ties broken by position in the sequence; pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas import Alert


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
