"""Turning records into JSON for humans and scripts (``stream-rl replay``), with sample content redacted.

Consumes: raw records (:class:`~stream_rl.transport.reader.Record`, value bytes) of any project topic, and a
secret key for the id hashes (:func:`redaction_key`).
Produces: one JSON-able dict per record: where it came from, its key, and the decoded message in the wire layout
of docs/wire-format.md (``schemas.to_jsonable``), or the decode error when the record is invalid, or, for a
record in a batch the client cannot read (a codec it lacks, a corrupt batch), ``unreadable: true`` with the
reason (the read goes on after it: see :meth:`stream_rl.transport.reader.Reader.read_range`).
Guarantees: unless ``show_content`` is set, every field that carries sample content is replaced, per message kind
(:data:`CONTENT_FIELDS`; docs/status-and-traces.md, "stream-rl replay"):

- texts (prompt/response text, answers) and metadata values -> ``"<redacted: N chars>"`` (metadata keys stay);
  a prompt's ``messages`` keep their roles, every other value of a message is redacted so;
- token ids -> ``"<redacted: N tokens>"`` (a character tokenizer would spell the text out);
- raw bytes (dead letters' ``raw_value``/``raw_key``, weights chunks' ``data``) -> ``"<redacted: N chars>"``
  (N counts the base64 characters);
- ids that contain a prompt id (``prompt_id``, ``group_id``, ``rollout_id``, the record key of prompts, rollouts,
  scored and stale rollouts, partial groups (whose embedded prompt is redacted as a prompt) and dead letters, and
  of undecodable records) -> the prompt id becomes ``#`` + 16 hex
  digits of HMAC-SHA256 under the key, the epoch and sample suffixes stay: ``add-12-34:0:5`` -> ``#1f..9a:0:5``.
  The same prompt id gives the same hash with the same key, so records stay joinable across topics and
  invocations, and the hash cannot be checked against guessed prompt ids without the key;
- quoted values in a dead letter's ``reason`` and in a decode ``error`` (``'...'`` or ``"..."``, how the
  validation errors quote what they saw) -> ``<redacted: N chars>``.

Kept as they are: numbers (log-probabilities, policy versions, rewards, timings, lengths), the epoch and sample
index, producer/scorer/trainer ids, finish reasons, weights manifests, heartbeats and alerts (which carry no
sample text), and ``raw_sha256``/``raw_size`` of dead letters (to check a record against its source).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path
from typing import Any

from schemas import SchemaError, decode, to_jsonable
from stream_rl.transport.unreadable import SkippedRecord

TEXT, TOKENS, VALUES, BYTES, ID, QUOTED, ROLLOUT = "text", "tokens", "values", "bytes", "id", "quoted", "rollout"
MESSAGES = "messages"  # a conversation: each message's role kept, its content (and name, ...) redacted
_ROLLOUT = {"rollout_id": ID, "prompt_id": ID, "group_id": ID, "prompt_token_ids": TOKENS,
            "response_token_ids": TOKENS, "prompt_text": TEXT, "response_text": TEXT, "answer": TEXT,
            "metadata": VALUES}
CONTENT_FIELDS: dict[str, dict[str, str]] = {
    "prompt": {"prompt_id": ID, "text": TEXT, "answer": TEXT, "metadata": VALUES, "prompt_token_ids": TOKENS,
               "messages": MESSAGES},
    "rollout": _ROLLOUT,
    "scored_rollout": {"rollout": ROLLOUT},
    "stale_rollout": {"rollout_id": ID, "prompt_id": ID, "group_id": ID},
    "partial_group": {"group_id": ID, "prompt": ROLLOUT, "prompt_token_ids": TOKENS, "token_ids": TOKENS},
    "member_rejected": {"rollout_id": ID, "group_id": ID, "reason": QUOTED},
    "dead_letter": {"raw_value": BYTES, "raw_key": BYTES, "reason": QUOTED},
    "weights_chunk": {"data": BYTES},
    "weights_manifest": {}, "heartbeat": {}, "alert": {},
}
"""Per message kind: the fields that carry sample content and how each is redacted (module docstring)."""
PLAIN_KEYS = frozenset({"weights_manifest", "weights_chunk", "heartbeat", "alert"})
"""Kinds whose record key (a version, an instance id, an alert name) is printed as is."""
_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'?|\"(?:[^\"\\]|\\.)*\"?")
KEY_FILE = "replay.key"


def redaction_key(state_dir: Path) -> bytes:
    """The machine's secret for id hashes: ``state_dir/replay.key``, created (0600, 32 random bytes) on first use."""
    path = Path(state_dir) / KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return bytes.fromhex(path.read_text().strip())
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32))
    return bytes.fromhex(path.read_text().strip())


class Redactor:
    """Applies :data:`CONTENT_FIELDS` to decoded messages, hashing ids under ``key``."""

    def __init__(self, key: bytes):
        self.key = key

    def hash_id(self, value: str, suffixes: int = 2) -> str:
        """``value`` with its prompt-id part hashed; up to ``suffixes`` trailing ``:<digits>`` parts kept."""
        parts = value.split(":")
        kept: list[str] = []
        while len(kept) < suffixes and len(parts) > 1 and parts[-1].isdigit():
            kept.insert(0, parts.pop())
        digest = hmac.new(self.key, ":".join(parts).encode(), hashlib.sha256).hexdigest()[:16]
        return ":".join([f"#{digest}", *kept])

    def field(self, how: str, value: Any) -> Any:
        if value is None:
            return None
        if how == ID:
            return self.hash_id(value)
        if how == TOKENS:
            return f"<redacted: {len(value)} tokens>"
        if how == VALUES:
            return {k: _chars(v) for k, v in value.items()}
        if how == MESSAGES:
            return [{k: v if k == "role" else _chars(v) for k, v in message.items()} for message in value]
        if how == QUOTED:
            return scrub_quoted(value)
        if how == ROLLOUT:  # an embedded message (a scored rollout's rollout, a partial group's prompt)
            return self.message(value)
        return _chars(value)  # TEXT, BYTES

    def message(self, value: dict[str, Any]) -> dict[str, Any]:
        """A copy of one decoded message with its content fields redacted."""
        rules = CONTENT_FIELDS.get(value.get("kind"), _ROLLOUT if "rollout_id" in value else {})
        return {k: self.field(rules[k], v) if k in rules else v for k, v in value.items()}

    def key_of(self, key: str | None, kind: str | None) -> str | None:
        """The record key: as is for :data:`PLAIN_KEYS`, else (a prompt or group id, or unknown) hashed."""
        if key is None or kind in PLAIN_KEYS:
            return key
        return self.hash_id(key, suffixes=1)


def _chars(value: Any) -> str:
    return f"<redacted: {len(value)} chars>"


def scrub_quoted(text: str) -> str:
    """``text`` with every quoted span (``'...'``, ``"..."``, a repr cut short included) replaced by its length."""
    return _QUOTED.sub(lambda m: _chars(m.group(0)), text)


def record_to_json(rec: Any, show_content: bool = False, redactor: Redactor | None = None) -> dict[str, Any]:
    """A record as a JSON-able dict: origin, key, and the decoded message or the decode error (redacted
    by ``redactor`` unless ``show_content``)."""
    if isinstance(rec, SkippedRecord):
        return {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset, "unreadable": True,
                "error": rec.reason, "error_type": rec.error_type}
    if not show_content and redactor is None:
        raise ValueError("record_to_json: a Redactor is needed unless show_content is set")
    key = rec.key.decode(errors="replace") if rec.key is not None else None
    out: dict[str, Any] = {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset,
                           "timestamp_ms": rec.timestamp_ms, "key": key}
    try:
        value = to_jsonable(decode(rec.value))
    except SchemaError as exc:
        out["error"] = str(exc) if show_content else scrub_quoted(str(exc))
        out["value_bytes"] = len(rec.value or b"")
        if not show_content:
            out["key"] = redactor.key_of(key, None)
        return out
    if not show_content:
        out["key"] = redactor.key_of(key, value.get("kind"))
        value = redactor.message(value)
    out["value"] = value
    return out
