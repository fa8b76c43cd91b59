"""Record keys: which key each kind that roles consume in groups must carry.

Consumes: decoded schema messages and their record keys.
Produces: :data:`KEY_FIELDS` and :func:`key_problem`, the reason a record's key is wrong (the edge dead-letters
such a record on a role's input with error type ``KeyError``).
Guarantees: keys decide partitions, so a record keyed otherwise than its documented key
(docs/wire-format.md) is named, never silently accepted.
"""

from __future__ import annotations

from typing import Any

KEY_FIELDS = {"prompt": "prompt_id", "rollout": "group_id", "scored_rollout": "group_id",
              "member_rejected": "group_id"}
"""The documented record key of each kind that roles consume in groups (docs/wire-format.md): the key decides
the partition (murmur2 of the key, as kafka-python and Apache Kafka's Java client place it), and a group must
stay on one partition."""


def key_problem(value: Any, key: bytes | None) -> str | None:
    """Why ``key`` is not the documented key of ``value`` (None when it is, or the kind has no key rule)."""
    name = KEY_FIELDS.get(getattr(value, "KIND", ""))
    if name is None:
        return None
    want = getattr(value, name).encode()
    if key != want:
        return (f"record key {key!r:.80} is not the documented key ({name} {want!r:.80}): "
                f"keys decide partitions, so a group must be keyed by its {name}")
    return None
