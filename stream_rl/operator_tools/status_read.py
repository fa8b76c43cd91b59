"""Reads a run's topics for ``stream-rl status``: high-water marks, topic tails and committed group offsets.

Consumes: a :class:`~stream_rl.config.shared.SharedConfig` (broker address, topic prefix and run).
Produces: :class:`StatusReader` whose :meth:`~StatusReader.snapshot` returns the dict of
:func:`stream_rl.operator_tools.status.build_snapshot`.
Guarantees:
- Read-only: a group-less reader (never commits, joins no group) plus an admin client for OffsetFetch; nothing
  is created or sent, and no span is exported (the reader's tracing has no exporter).
- The status, weights and alerts topics are read from their tail only: at most ``tail`` records per partition
  ending at the high-water mark, so a long run's status topic costs the same as a short one's. Heartbeats and
  alerts older than the tail are not seen (an instance silent for that long is not shown at all).
- An unreachable broker raises :class:`StatusError` with one line naming the address, before any other call.
- Records that do not decode as the expected kind are skipped (they are the dead-letter topic's business).
- Endpoint files (``run_dir/endpoints/*.json``) are read on every snapshot; one that is not a JSON object (torn
  by a writer, foreign) is skipped. A pid counts as running while ``kill(pid, 0)`` finds it and it is no zombie.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from schemas import SchemaError, decode
from stream_rl.config.shared import SharedConfig
from stream_rl.operator_tools.status import build_snapshot, endpoint_rows
from stream_rl.transport.topics import CONSUMER_GROUPS, LOGICAL_TOPICS

TAIL = 500
"""Default number of records read from the end of each partition of the status and alerts topics."""
WEIGHTS_TAIL = 20
"""Records read from the end of the weights topic (manifests; the newest version is among the last ones)."""


def read_endpoints(directory: Path) -> list[dict[str, Any]]:
    """The endpoint records in ``directory`` (``<instance_id>.json``; hidden temporary files left out)."""
    if not directory.is_dir():
        return []
    out = []
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def pid_running(pid: int) -> bool:
    """True while process ``pid`` exists on this host and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (not Linux), or it just ended
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


class StatusError(RuntimeError):
    """The broker cannot be reached or does not answer as expected."""


class StatusReader:
    """One connection to the broker, reused across refreshes of the live view."""

    def __init__(self, cfg: SharedConfig, tail: int = TAIL):
        from stream_rl.broker import BrokerError, answers_metadata, resolve_bootstrap
        from stream_rl.transport.client import Transport
        from stream_rl.transport.tracing import Tracing

        try:
            bootstrap = resolve_bootstrap(cfg.kafka.bootstrap_servers, cfg.broker)
        except BrokerError as exc:
            raise StatusError(str(exc)) from exc
        if not answers_metadata(bootstrap):
            raise StatusError(f"broker {bootstrap} is unreachable (no answer to a metadata request)")
        self.cfg, self.tail = cfg, tail
        self.transport = Transport(cfg, "status", tracing=Tracing("stream-rl-status"))
        self.names = self.transport.names
        self.reader = self.transport.reader()
        self.admin = self.transport.admin()
        self.groups = {self.names.group(name): topic for name, topic in CONSUMER_GROUPS.items()}
        self._previous: tuple[float, dict[str, list[int]]] | None = None

    def close(self) -> None:
        self.reader.close()
        self.admin.close()

    # -- reading --------------------------------------------------------------------------------------------
    def partitions(self) -> dict[str, list[tuple[str, int]]]:
        """{logical topic: its (topic, partition) pairs} for the run's topics that exist."""
        existing = self.reader.topics()
        return {logical: self.reader.partitions(self.names.name(logical)) for logical in LOGICAL_TOPICS
                if self.names.name(logical) in existing}

    def highwaters(self, parts: dict[str, list[tuple[str, int]]]) -> dict[str, list[int]]:
        """High-water mark of every partition, per logical topic (one fetch round for all of them)."""
        every = [tp for tps in parts.values() for tp in tps]
        marks = self.reader.highwaters(every) if every else {}
        return {logical: [marks[tp] for tp in tps] for logical, tps in parts.items()}

    def tail_messages(self, tps: list[tuple[str, int]], marks: list[int], count: int, kind: str) -> list[Any]:
        """The decodable ``kind`` messages among the last ``count`` records of each partition."""
        out = []
        for tp, mark in zip(tps, marks, strict=True):
            if mark == 0:
                continue
            for rec in self.reader.read_range(tp, max(mark - count, 0), count):
                try:
                    out.append(decode(rec.value, kind))
                except SchemaError:
                    continue
        return out

    def committed(self) -> dict[str, dict[int, int | None]]:
        """{group: {partition: committed offset}} on the topic each of the run's groups consumes."""
        found = self.admin.group_offsets(self.groups)
        out: dict[str, dict[int, int | None]] = {}
        for group, topic in self.groups.items():
            full = self.names.name(topic)
            out[group] = {partition: offset for (name, partition), offset in found.get(group, {}).items()
                          if name == full}
        return out

    def snapshot(self, sample_s: float = 0.0) -> dict[str, Any]:
        """One snapshot; throughput from the previous call's marks, or from a second sample ``sample_s`` later."""
        parts = self.partitions()
        marks, taken = self.highwaters(parts), time.time()
        if self._previous is None and sample_s > 0:
            self._previous = (taken, marks)
            time.sleep(sample_s)
            marks, taken = self.highwaters(parts), time.time()
        previous = self._previous
        self._previous = (taken, marks)

        def tail(logical: str, count: int, kind: str) -> list[Any]:
            return self.tail_messages(parts[logical], marks[logical], count, kind) if logical in parts else []

        manifests = tail("weights", WEIGHTS_TAIL, "weights_manifest")
        return build_snapshot(
            run=self.names.run, now=time.time(), heartbeats=tail("status", self.tail, "heartbeat"),
            manifest=max(manifests, key=lambda m: (m.version, m.created_at)) if manifests else None,
            marks=marks, previous_marks=previous[1] if previous else None,
            dt_s=taken - previous[0] if previous else None, committed=self.committed(), groups=self.groups,
            alerts=tail("alerts", self.tail, "alert"),
            endpoints=endpoint_rows(read_endpoints(Path(self.cfg.run_dir) / "endpoints"), socket.gethostname(),
                                    pid_running))
