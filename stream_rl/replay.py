"""Turning records into JSON for humans and scripts (``stream-rl replay``), with text redacted.

Consumes: raw Kafka records (value bytes) of any project topic.
Produces: one JSON-able dict per record: where it came from, its key, and the decoded message in the wire layout
of docs/wire-format.md (``schemas.to_jsonable``), or the decode error when the record is invalid, or, for a
record in a batch the client cannot read (a codec it lacks, a corrupt batch), ``unreadable: true`` with the
reason (the read goes on after it: see :func:`stream_rl.transport.client.read_range`).
Guarantees: prompt and response text, and raw payload bytes (which may contain text), are replaced by a
``<redacted: N chars>`` marker unless ``show_text`` is set.
"""

from __future__ import annotations

from typing import Any

from schemas import SchemaError, decode, to_jsonable
from stream_rl.transport.unreadable import SkippedRecord

REDACTED_FIELDS = frozenset({"text", "prompt_text", "response_text", "raw_value", "raw_key", "data"})


def redact(value: Any) -> Any:
    """A copy of a JSON-able tree with every field named in REDACTED_FIELDS replaced by its length."""
    if isinstance(value, dict):
        return {k: (f"<redacted: {len(v)} chars>" if k in REDACTED_FIELDS and isinstance(v, str) else redact(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def record_to_json(rec: Any, show_text: bool = False) -> dict[str, Any]:
    """A Kafka record as a JSON-able dict: origin, key, and the decoded message or the decode error."""
    if isinstance(rec, SkippedRecord):
        return {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset, "unreadable": True,
                "error": rec.reason, "error_type": rec.error_type}
    out: dict[str, Any] = {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset,
                           "timestamp_ms": rec.timestamp,
                           "key": rec.key.decode(errors="replace") if rec.key is not None else None}
    try:
        value = to_jsonable(decode(rec.value))
        out["value"] = value if show_text else redact(value)
    except SchemaError as exc:
        out["error"] = str(exc)
        out["value_bytes"] = len(rec.value or b"")
    return out
