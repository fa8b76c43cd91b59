"""The status snapshot of a running pipeline, built from what its topics hold (pure: no Kafka, no clock).

Consumes: ``Heartbeat`` records (status topic), the newest ``WeightsManifest`` (weights topic), ``Alert`` records
(alerts topic), per-topic high-water marks (two samples ``dt_s`` apart, for throughput) and the committed offsets
of the run's consumer groups, the run directory's endpoint records; ``now`` (Unix seconds) and the pid check are
passed in.
Produces: one JSON-ready dict (see :func:`build_snapshot`) that ``stream-rl status`` prints as JSON or renders as
tables::

    {"run", "time", "roles": [...], "weights": {...} | None, "topics": {...}, "lag": {...},
     "trainer_metrics": {...}, "data": {"epoch", "distinct_prompts"}, "alerts": [...], "endpoints": [...],
     "reward_calls": {scorer instance: {"rewards/<reward>/<data_source>/<metric>": value}},
     "servers": {producer instance: {"servers/<i>/<metric>": value}},
     "environments": {producer or driver instance: {"env/<name>/<outcome>": episodes}},
     "gateways": {gateway instance: {"gateway/<counter>": value}}}

Guarantees:
- Per instance only its newest heartbeat counts (by ``created_at``); an instance is ``alive`` when that heartbeat
  is at most ``MISSED_INTERVALS * interval_s`` seconds old, else ``missing``.
- The weights version is the newest manifest's; without one, the newest live trainer heartbeat's version.
  A producer's staleness is ``weights version - its heartbeat's policy_version`` (None while either is unknown);
  a gateway's likewise (the policy it samples with); an evaluator's likewise: how many versions its last
  evaluation is behind.
- Lag of a group's partition is ``high-water mark - committed offset`` (the whole partition when the group has
  committed nothing there yet); high-water marks come from fetch responses, never ListOffsets.
- An alert is open when the newest transition of its ``(instance_id, name)`` is ``firing``.
- ``data``: the trainer's ``data/epoch`` (highest epoch trained so far, 0-based) and ``data/distinct_prompts``
  (prompt ids trained at least once) from its newest heartbeat's metrics (the metrics.jsonl row); None each
  while the trainer does not report it.
- ``endpoints``: one row per ``run_dir/endpoints/<instance_id>.json``; ``process`` is ``stale`` when the file's
  host is this host and its pid is not running (a role that died without removing it; a reused pid reads as
  running), ``unknown`` for another host.
- Heartbeats and alerts never carry sample text (schemas/messages.py), so neither does the snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from stream_rl.alerts.read import open_alerts as fold_alerts
from stream_rl.telemetry.lag import compute_lag

MISSED_INTERVALS = 3
"""An instance whose newest heartbeat is older than this many of its intervals is shown as missing."""

def latest_per_instance(heartbeats: Iterable[Any]) -> dict[str, Any]:
    """The newest heartbeat (by ``created_at``) of each ``instance_id``."""
    latest: dict[str, Any] = {}
    for hb in heartbeats:
        seen = latest.get(hb.instance_id)
        if seen is None or hb.created_at >= seen.created_at:
            latest[hb.instance_id] = hb
    return latest


def is_alive(hb: Any, now: float) -> bool:
    """True while the heartbeat is at most ``MISSED_INTERVALS`` intervals old."""
    return now - hb.created_at <= MISSED_INTERVALS * hb.interval_s


def weights_version(manifest: Any | None, latest: Mapping[str, Any], now: float) -> int | None:
    """The current weights version: the newest manifest's, else the newest live trainer heartbeat's (>= 0)."""
    if manifest is not None:
        return int(manifest.version)
    trainers = [hb for hb in latest.values() if hb.role == "trainer" and is_alive(hb, now) and hb.policy_version >= 0]
    return max(trainers, key=lambda hb: hb.created_at).policy_version if trainers else None


def role_rows(latest: Mapping[str, Any], now: float, version: int | None) -> list[dict[str, Any]]:
    """One row per instance, sorted by (role, instance id); producers and evaluators get their staleness."""
    rows = []
    for hb in sorted(latest.values(), key=lambda h: (h.role, h.instance_id)):
        stale = (version - hb.policy_version if hb.role in ("producer", "gateway", "evaluator") and version is not None
                 and hb.policy_version >= 0 else None)
        rows.append({"role": hb.role, "instance_id": hb.instance_id, "host": hb.host, "pid": hb.pid,
                     "status": "alive" if is_alive(hb, now) else "missing", "state": hb.state,
                     "age_s": round(now - hb.created_at, 3), "policy_version": hb.policy_version, "step": hb.step,
                     "staleness": stale, "rates": dict(hb.rates), "open_alerts": list(hb.open_alerts)})
    return rows


def topic_rows(marks: Mapping[str, list[int]], previous: Mapping[str, list[int]] | None,
               dt_s: float | None) -> dict[str, dict[str, Any]]:
    """Per logical topic: partitions, records (sum of high-water marks) and records/s between two samples."""
    out = {}
    for topic, hws in sorted(marks.items()):
        rate = None
        if previous is not None and dt_s and topic in previous and len(previous[topic]) == len(hws):
            rate = round(max(sum(hws) - sum(previous[topic]), 0) / dt_s, 3)
        out[topic] = {"partitions": len(hws), "records": sum(hws), "highwaters": list(hws), "records_per_s": rate}
    return out


def lag_rows(marks: Mapping[str, list[int]], committed: Mapping[str, Mapping[int, int | None]],
             groups: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Per consumer group (``{full group: logical topic}``): lag per partition and in total."""
    out = {}
    for group, topic in groups.items():
        if topic not in marks:
            continue
        offsets = committed.get(group, {})
        lags = compute_lag(dict(enumerate(marks[topic])), offsets)  # the roles' own lag formula
        parts = [{"partition": partition, "highwater": hw, "committed": offsets.get(partition),
                  "lag": lags[partition]} for partition, hw in enumerate(marks[topic])]
        out[group] = {"topic": topic, "total": sum(p["lag"] for p in parts), "partitions": parts}
    return out


def open_alerts(alerts: Iterable[Any]) -> list[dict[str, Any]]:
    """Alerts whose newest transition per ``(instance_id, name)`` is ``firing``, oldest first (the fold of
    :func:`stream_rl.alerts.read.open_alerts`), as plain dicts."""
    return [{"name": a.name, "role": a.role, "instance_id": a.instance_id, "action": a.action,
             "message": a.message, "value": a.value, "threshold": a.threshold, "since": a.created_at}
            for a in fold_alerts(alerts)]


def trainer_metrics(latest: Mapping[str, Any]) -> dict[str, float]:
    """The newest trainer heartbeat's metrics (finite values only)."""
    trainers = [hb for hb in latest.values() if hb.role == "trainer"]
    if not trainers:
        return {}
    hb = max(trainers, key=lambda h: h.created_at)
    return {k: v for k, v in sorted(hb.metrics.items()) if isinstance(v, (int, float)) and math.isfinite(v)}


def reward_calls(latest: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per scorer instance, the reward-call metrics of its newest heartbeat (``rewards/<reward>/<data_source>/
    {latency_p50_s, latency_p99_s, calls, timeouts, retries, errors, zeroed}``, its last batch), finite only."""
    return {hb.instance_id: {k: v for k, v in sorted(hb.metrics.items())
                             if k.startswith("rewards/") and isinstance(v, (int, float)) and math.isfinite(v)}
            for hb in sorted(latest.values(), key=lambda h: h.instance_id)
            if hb.role == "scorer" and any(k.startswith("rewards/") for k in hb.metrics)}


def inference_servers(latest: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per producer instance driving inference servers (``producer.engine = "server"``), the fleet metrics of its
    newest heartbeat (``servers/total``, ``servers/healthy``, ``servers/I/{healthy, outstanding, requests, tokens,
    failures, version}``), finite only."""
    return {hb.instance_id: {k: v for k, v in sorted(hb.metrics.items())
                             if k.startswith("servers/") and isinstance(v, (int, float)) and math.isfinite(v)}
            for hb in sorted(latest.values(), key=lambda h: h.instance_id)
            if hb.role == "producer" and any(k.startswith("servers/") for k in hb.metrics)}


def environments(latest: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per producer instance playing multi-turn episodes (``producer.environment``) and per driver, its
    environments' episodes by outcome from its newest heartbeat (``env/<name>/{ok, failed, timed_out, refilled}``,
    a driver's with ``abandoned`` too; since it started), finite only."""
    return {hb.instance_id: {k: v for k, v in sorted(hb.metrics.items())
                             if k.startswith("env/") and isinstance(v, (int, float)) and math.isfinite(v)}
            for hb in sorted(latest.values(), key=lambda h: h.instance_id)
            if hb.role in ("producer", "driver") and any(k.startswith("env/") for k in hb.metrics)}


def gateways(latest: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per gateway instance, its counters from its newest heartbeat (``gateway/episodes_{open, ended, published,
    dead_lettered}`` now, ``gateway/{calls, tokens, dropped_clients}`` since it started), finite only."""
    return {hb.instance_id: {k: v for k, v in sorted(hb.metrics.items())
                             if k.startswith("gateway/") and isinstance(v, (int, float)) and math.isfinite(v)}
            for hb in sorted(latest.values(), key=lambda h: h.instance_id) if hb.role == "gateway"}


def data_progress(metrics: Mapping[str, float]) -> dict[str, int | None]:
    """The trainer's ``data/epoch`` (highest epoch trained, 0-based) and ``data/distinct_prompts`` (prompt ids
    trained at least once) from its last metrics; None where the trainer does not report it."""
    return {name: int(metrics[key]) if key in metrics else None
            for name, key in (("epoch", "data/epoch"), ("distinct_prompts", "data/distinct_prompts"))}


def endpoint_rows(records: Iterable[Mapping[str, Any]], this_host: str,
                  pid_running: Callable[[int], bool]) -> list[dict[str, Any]]:
    """One row per endpoint file, sorted by (role, instance id): ``process`` is ``running`` or ``stale`` (its pid
    is not running here: the role died without removing its file) on ``this_host``, ``unknown`` on another host."""
    rows = []
    for rec in records:
        pid, host = rec.get("pid"), rec.get("host")
        if host != this_host or not isinstance(pid, int):
            process = "unknown"
        else:
            process = "running" if pid_running(pid) else "stale"
        rows.append({"role": rec.get("role"), "instance_id": rec.get("instance_id"), "url": rec.get("url"),
                     "host": host, "pid": pid, "process": process})
    return sorted(rows, key=lambda r: (str(r["role"]), str(r["instance_id"])))


def build_snapshot(*, run: str, now: float, heartbeats: Iterable[Any], manifest: Any | None,
                   marks: Mapping[str, list[int]], previous_marks: Mapping[str, list[int]] | None = None,
                   dt_s: float | None = None, committed: Mapping[str, Mapping[int, int | None]] | None = None,
                   groups: Mapping[str, str] | None = None, alerts: Iterable[Any] = (),
                   endpoints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The whole snapshot (module docstring); ``marks`` are high-water marks per logical topic and partition,
    ``endpoints`` the rows of :func:`endpoint_rows`."""
    latest = latest_per_instance(heartbeats)
    version = weights_version(manifest, latest, now)
    weights = None
    if manifest is not None:
        weights = {"version": manifest.version, "step": manifest.step, "mode": manifest.mode,
                   "total_bytes": manifest.total_bytes, "age_s": round(now - manifest.created_at, 3)}
    elif version is not None:
        weights = {"version": version, "step": None, "mode": None, "total_bytes": None, "age_s": None}
    metrics = trainer_metrics(latest)
    return {"run": run, "time": now, "roles": role_rows(latest, now, version), "weights": weights,
            "topics": topic_rows(marks, previous_marks, dt_s),
            "lag": lag_rows(marks, committed or {}, groups or {}),
            "trainer_metrics": metrics, "data": data_progress(metrics), "alerts": open_alerts(alerts),
            "reward_calls": reward_calls(latest), "servers": inference_servers(latest),
            "environments": environments(latest), "gateways": gateways(latest),
            "endpoints": list(endpoints or [])}
