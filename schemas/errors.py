"""The one error type raised by the wire schemas.

Consumes: nothing. Produces: :class:`SchemaError`, raised by ``decode``, ``validate``, ``encode`` and
``message_kind`` for every problem with a record or message (not msgpack, not a map, unknown kind, unsupported
``schema_version``, missing field, wrong type, dtype, shape or length, out-of-range value, malformed id).

Guarantees: ``SchemaError`` is a ``ValueError``; it carries the dotted name of the offending field (``field``,
``"<root>"`` when the record as a whole is bad), a human ``reason``, and the message ``kind`` when known, so a
dead-letter record can state exactly what was wrong::

    invalid rollout.behavior_logprobs: contains NaN at index 3
    invalid scored_rollout.rollout.sample_index: must be < group_size (4), got 4
    invalid message: not valid msgpack (unpack(b) received extra data.)

It survives pickling (multiprocessing, logging handlers) with its attributes intact.
"""

from __future__ import annotations

ROOT = "<root>"
"""Field name used when the record as a whole is invalid (not msgpack, not a map, not bytes)."""


class SchemaError(ValueError):
    """A record or message does not satisfy the wire schema.

    Attributes:
        field: dotted field name (``"behavior_logprobs"``, ``"rollout.epoch"``, ``"tensors[2].offset"``,
            ``"schema_version"``) or ``"<root>"``.
        reason: what is wrong, for a human.
        kind: the message kind when it is known (``"rollout"``), else ``None``.
    """

    def __init__(self, field: str, reason: str, kind: str | None = None) -> None:
        super().__init__(field, reason, kind)
        self.field = field
        self.reason = reason
        self.kind = kind

    def __str__(self) -> str:
        subject = self.kind or "message"
        if self.field == ROOT:
            return f"invalid {subject}: {self.reason}"
        return f"invalid {subject}.{self.field}: {self.reason}"

    def nested(self, parent: str) -> SchemaError:
        """The same error seen from an enclosing structure: ``field`` becomes ``parent.field`` (``parent[i]...``)."""
        if self.field == ROOT:
            field = parent
        elif self.field.startswith("["):
            field = f"{parent}{self.field}"
        else:
            field = f"{parent}.{self.field}"
        return SchemaError(field, self.reason, self.kind)

    def with_kind(self, kind: str | None) -> SchemaError:
        """The same error attributed to message ``kind`` (the outermost message wins)."""
        return SchemaError(self.field, self.reason, kind)


def wire_type_name(value: object) -> str:
    """The msgpack name of a Python value's type, for error reasons (``nil``, ``int``, ``bin``, ``map`` ...)."""
    names = {type(None): "nil", bool: "bool", int: "int", float: "float", str: "str", bytes: "bin",
             bytearray: "bin", list: "array", tuple: "array", dict: "map"}
    return names.get(type(value), type(value).__name__)
