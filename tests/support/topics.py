"""Test helper: read back what the roles wrote, from the broker (whole topics, read by assignment without a
consumer group, so no group join to wait for) and from a role's JSON-lines telemetry file."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from schemas import Heartbeat, SchemaError, decode, message_kind


def read_records(transport, topic: str, kind: str | None = None) -> list[SimpleNamespace]:
    """Every record of ``topic`` (a full name) up to its high-water marks, partition by partition, as
    ``(partition, offset, key, headers, value)``; ``value`` decoded as ``kind``, or the raw bytes when None.
    With ``kind``, records of another kind that shares the topic (``SHARED``) are left out; any other record
    must decode as ``kind``."""
    with transport.reader() as reader:
        return [SimpleNamespace(partition=rec.partition, offset=rec.offset, key=rec.key, headers=rec.headers,
                                value=rec.value if kind is None else decode(rec.value, kind))
                for tp in reader.partitions(topic) for rec in reader.read_range(tp, 0, None)
                if kind is None or _kind_or_none(rec.value) not in SHARED.get(kind, ())]


SHARED = {"scored_rollout": ("member_rejected",)}
"""Kinds written to the same topic as another (docs/wire-format.md): scorers write ``member_rejected`` notices
on the scored topic."""


def _kind_or_none(value: bytes | None) -> str | None:
    try:
        return message_kind(value)
    except SchemaError:
        return None


def read_values(transport, topic: str, kind: str) -> list:
    """The decoded messages of ``topic``, partition by partition."""
    return [r.value for r in read_records(transport, topic, kind)]


def committed(transport, group: str) -> dict[tuple[str, int], int]:
    """``{(topic, partition): offset}`` the consumer ``group`` has committed (the roles' own reader of it)."""
    with transport.admin() as admin:
        return admin.committed_offsets(group)


def heartbeats(transport, instance_id: str) -> list[Heartbeat]:
    """Every heartbeat of ``instance_id`` on the run's status topic, oldest first."""
    beats = read_values(transport, transport.names.status, "heartbeat")
    return sorted((b for b in beats if b.instance_id == instance_id), key=lambda b: b.created_at)


def only_export(run_dir: str | Path) -> tuple[str, dict[str, list[dict]]]:
    """The instance id of the one role that wrote ``run_dir/telemetry/*.jsonl`` and its last export:
    ``{metric name: its points}``."""
    files = sorted((Path(run_dir) / "telemetry").glob("*.jsonl"))
    assert len(files) == 1, files
    last = json.loads(files[0].read_text().splitlines()[-1])
    return last["instance_id"], {m["name"]: m["points"] for m in last["metrics"]}


def total(export: dict[str, list[dict]], name: str, field: str = "value", **labels) -> float:
    """The sum of ``field`` over the points of ``name`` whose attributes include ``labels``."""
    points = [p for p in export.get(name, []) if labels.items() <= p["attributes"].items()]
    assert points, f"no {name} point with {labels}"
    return sum(p[field] for p in points)


def check_role_telemetry(cfg, transport, role: str, *, topic_in: str, records_in: int, topic_out: str,
                         records_out: int, tokens: int, stage: str, batches: int) -> None:
    """The one role that ran in ``cfg.run_dir`` exported these counts (records in and out per topic, tokens, one
    ``stage`` timing per batch) and sent heartbeats as ``role``, the last one ``stopping``."""
    instance, export = only_export(cfg.run_dir)
    assert total(export, "stream_rl_records_in_total", topic=topic_in, role=role) == records_in
    assert total(export, "stream_rl_records_out_total", topic=topic_out) == records_out
    assert total(export, "stream_rl_tokens_total") == tokens
    assert total(export, "stream_rl_processing_seconds", "count", stage=stage) == batches
    beats = heartbeats(transport, instance)
    assert beats and {b.role for b in beats} == {role} and beats[-1].state == "stopping"


def end_offsets(transport, topic: str) -> dict[tuple[str, int], int]:
    """``{(topic, partition): offset after its last record}`` of every partition of ``topic`` that holds records."""
    ends: dict[tuple[str, int], int] = {}
    for rec in read_records(transport, topic):
        key = (topic, rec.partition)
        ends[key] = max(ends.get(key, 0), rec.offset + 1)
    return ends


def caught_up(transport, group: str, topic: str) -> bool:
    """True when consumer ``group`` has committed every record of ``topic``: its committed offset of each partition
    is that partition's end. A deterministic "nothing more will arrive" check: a consumer that commits after it
    handled a batch has handled (or re-read) everything there is once this holds, with no sleep window."""
    ends = end_offsets(transport, topic)
    got = committed(transport, group)
    return bool(ends) and all(got.get(tp) == end for tp, end in ends.items())
