"""Encode and decode stream-rl messages: typed messages <-> msgpack record values, validated both ways.

Consumes: message objects (``encode``, ``validate``, ``to_jsonable``) or record value bytes (``decode``,
``message_kind``). Produces: msgpack bytes laid out as docs/wire-format.md specifies, typed messages, kind strings,
or JSON-ready dicts.

Guarantees:
- ``encode`` validates first, so nothing invalid is ever sent; ``decode`` validates everything it returns, so a
  consumer never sees an invalid message. Both raise only :class:`SchemaError`, attributed to the outermost kind
  (``invalid scored_rollout.rollout.epoch: must be >= 0, got -1``).
- msgpack only (``use_bin_type=True`` on write; ``raw=False, strict_map_key=True`` on read): no pickle, no
  extension types; invalid UTF-8, trailing bytes and truncated input are rejected.
- ``decode(data, expected_kind)`` rejects a record of another kind before reading its fields, so a consumer of
  one topic cannot be handed a different message type.
- Unknown extra fields are ignored; a ``schema_version`` above the class's ``SCHEMA_VERSION`` (or below 1) is
  rejected, never guessed at.
"""

from __future__ import annotations

import base64
from typing import Any

import msgpack

from schemas.arrays import decode_array
from schemas.errors import ROOT, SchemaError, wire_type_name
from schemas.messages import Message
from schemas.validation import check_message, message_from_wire, message_to_wire, read_envelope

_UNPACK_ERRORS = (ValueError, TypeError, msgpack.UnpackException)


def validate(msg: Message) -> Message:
    """Check every rule of ``msg``'s kind; return ``msg`` unchanged, or raise :class:`SchemaError`."""
    try:
        check_message(msg)
    except SchemaError as exc:
        raise exc.with_kind(getattr(msg, "KIND", None) or None) from None
    return msg


def encode(msg: Message) -> bytes:
    """The record value of ``msg``: a msgpack map (``kind``, ``schema_version``, fields), after ``validate``."""
    validate(msg)
    return msgpack.packb(message_to_wire(msg), use_bin_type=True)


def _bytes_of(data: Any) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError(ROOT, f"expected bytes, got {type(data).__name__}")
    return bytes(data)


def _unpack(data: Any) -> Any:
    try:
        return msgpack.unpackb(_bytes_of(data), raw=False, strict_map_key=True)
    except _UNPACK_ERRORS as exc:
        raise SchemaError(ROOT, f"not valid msgpack ({exc or type(exc).__name__})") from exc


def decode(data: bytes, expected_kind: str | tuple[str, ...] | None = None) -> Message:
    """The validated message in record value ``data``.

    ``expected_kind``: a kind or kinds the caller accepts; any other kind raises ``SchemaError`` on ``kind``.
    """
    raw = _unpack(data)
    cls = read_envelope(raw)
    allowed = (expected_kind,) if isinstance(expected_kind, str) else expected_kind
    if allowed is not None and cls.KIND not in allowed:
        raise SchemaError("kind", f"expected {' or '.join(map(repr, allowed))}, got {cls.KIND!r}", cls.KIND)
    try:
        return message_from_wire(raw, cls)
    except SchemaError as exc:
        raise exc.with_kind(cls.KIND) from None


def message_kind(data: bytes) -> str:
    """The ``kind`` of record value ``data``, read without decoding the other fields (which stay unchecked).

    Cheap when ``kind`` comes first, as ``encode`` writes it. Raises :class:`SchemaError` when ``data`` is not a
    msgpack map with a known ``kind``.
    """
    payload = _bytes_of(data)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(len(payload), 1024))
    unpacker.feed(payload)
    try:
        try:
            size = unpacker.read_map_header()
        except ValueError:
            raise SchemaError(ROOT, f"expected a msgpack map, got {wire_type_name(_unpack(payload))}") from None
        for _ in range(size):
            if unpacker.unpack() == "kind":
                return read_envelope({"kind": unpacker.unpack(), "schema_version": 1}).KIND
            unpacker.skip()
    except SchemaError:
        raise
    except _UNPACK_ERRORS as exc:
        raise SchemaError(ROOT, f"not valid msgpack ({exc or type(exc).__name__})") from exc
    raise SchemaError("kind", "missing")


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        if isinstance(obj.get("dtype"), str) and "shape" in obj and isinstance(obj.get("data"), bytes):
            return decode_array(obj).tolist()
        return {key: _plain(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_plain(value) for value in obj]
    if isinstance(obj, bytes):
        return base64.b64encode(obj).decode("ascii")
    return obj


def to_jsonable(msg: Message) -> dict[str, Any]:
    """``msg`` as JSON-ready data, the same shape ``ops/wire_reader.py`` prints: the wire map with arrays as
    (nested) lists and bytes as base64 strings."""
    validate(msg)
    return _plain(message_to_wire(msg))
