"""The rules of every message kind: field specs, cross-field checks, and the envelope.

Consumes: message objects (``check_message``, ``message_to_wire``) or msgpack-decoded maps
(``read_envelope``, ``message_from_wire``). Produces: validated messages or wire maps; errors as
:class:`SchemaError` naming the field relative to the message (the codec attributes the kind).

Guarantees:
- :data:`SPECS` lists every field of every message class, in dataclass order (a test keeps them in step); every
  listed field is required on the wire, except fields added after version 1 (:class:`~schemas.fields.Added`),
  which read as their documented default when absent; fields not listed are ignored on read (forward
  compatibility).
- The same rules run before encoding and after decoding, so whatever ``encode`` writes ``decode`` accepts
  (decoding runs each field's conversion and checks in one pass, ``read_fields``, then the cross-field rule).
- Cross-field rules: lengths of per-token arrays agree with the response, ``sample_index < group_size``, ids are
  the deterministic ones, a manifest's tensors tile the payload exactly and its chunk count and mode fields agree,
  a chunk's digest matches its bytes, a dead letter's ``raw_size`` / ``raw_sha256`` / ``raw_truncated`` agree
  with its ``raw_value``.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable

import numpy as np

from schemas.errors import ROOT, SchemaError, wire_type_name
from schemas.fields import (
    Added, Array, Bool, Bytes, Enum, FieldType, Float, Id, Int, MapList, Optional, Pattern, Shape, Spec, Str, StrList,
    StrMap, check_fields, fields_from_wire, fields_to_wire, read_fields,
)
from schemas.ids import (
    PROMPT_ID_MAX_LEN, SHA256_PATTERN, TOPIC_PATTERN, group_id_for, is_decimal, is_group_id, rollout_id_for,
)
from schemas.messages import (
    ALERT_ACTIONS, ALERT_STATES, MAX_GROUP_SIZE, MESSAGE_TYPES, ROLE_STATES, ROLES, SAFETENSORS_ITEMSIZE, Alert, DeadLetter,
    Evaluation, Heartbeat, MemberRejected, Message, Prompt, Rollout, ScoredRollout, StaleRollout, TensorEntry, WeightsChunk, WeightsManifest,
    chunk_count_for,
)

FINISH_REASONS = ("stop", "length", "abort")
WEIGHTS_MODES = ("inline", "store")


def read_envelope(raw: Any) -> type[Message]:
    """The message class named by wire map ``raw``'s ``kind``, after checking ``schema_version``."""
    if not isinstance(raw, dict):
        raise SchemaError(ROOT, f"expected a msgpack map, got {wire_type_name(raw)}")
    if "kind" not in raw:
        raise SchemaError("kind", "missing")
    kind = raw["kind"]
    if not isinstance(kind, str):
        raise SchemaError("kind", f"expected str, got {wire_type_name(kind)}")
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise SchemaError("kind", f"unknown kind {kind!r:.80}; known: {', '.join(sorted(MESSAGE_TYPES))}")
    if "schema_version" not in raw:
        raise SchemaError("schema_version", "missing", kind)
    version = raw["schema_version"]
    if type(version) is not int:
        raise SchemaError("schema_version", f"expected int, got {wire_type_name(version)}", kind)
    if not 1 <= version <= cls.SCHEMA_VERSION:
        raise SchemaError("schema_version",
                          f"unsupported version {version}; this reader supports 1..{cls.SCHEMA_VERSION}", kind)
    return cls


def check_message(msg: Message) -> None:
    """Every field rule, then the cross-field rule of ``msg``'s kind."""
    cls = type(msg)
    if cls not in SPECS:
        raise SchemaError(ROOT, f"expected a message, got {type(msg).__name__}")
    check_fields(msg, SPECS[cls])
    RULES[cls](msg)


def message_to_wire(msg: Message) -> dict[str, Any]:
    """The wire map of a checked ``msg``: ``kind``, ``schema_version``, then the fields."""
    return {"kind": msg.KIND, "schema_version": msg.SCHEMA_VERSION, **fields_to_wire(msg, SPECS[type(msg)])}


def message_from_wire(raw: Any, cls: type[Message]) -> Message:
    """The message of class ``cls`` read from wire map ``raw`` (envelope already checked) and checked: each field
    converted and checked in one pass (``read_fields``), then the cross-field rule, as :func:`check_message`."""
    msg = cls(**read_fields(raw, SPECS[cls]))
    RULES[cls](msg)
    return msg


class Embedded(FieldType):
    """A whole message embedded as a field: the same map, envelope included, as its own record."""

    def __init__(self, cls: type[Message]) -> None:
        self.cls = cls

    def check(self, value: Any) -> None:
        if not isinstance(value, self.cls):
            raise SchemaError(ROOT, f"expected a {self.cls.KIND} message, got {type(value).__name__}")
        check_message(value)

    def to_wire(self, value: Any) -> dict[str, Any]:
        return message_to_wire(value)

    def _class_of(self, raw: Any) -> type[Message]:
        cls = read_envelope(raw)
        if cls is not self.cls:
            raise SchemaError("kind", f"expected {self.cls.KIND!r}, got {cls.KIND!r}")
        return cls

    def from_wire(self, raw: Any) -> Any:
        cls = self._class_of(raw)
        return cls(**fields_from_wire(raw, SPECS[cls]))

    def read(self, raw: Any) -> Any:
        return message_from_wire(raw, self._class_of(raw))


TENSOR_SPEC: Spec = (
    ("name", Str(nonempty=True)), ("dtype", Enum(tuple(SAFETENSORS_ITEMSIZE))), ("shape", Shape()),
    ("offset", Int(0)), ("nbytes", Int(0)),
)


class TensorList(FieldType):
    """A non-empty array of tensor entries; errors name the entry (``tensors[2].nbytes``)."""

    def check(self, value: Any) -> None:
        if not isinstance(value, list) or not value:
            raise SchemaError(ROOT, f"expected a non-empty array of tensor entries, got {value!r:.80}")
        for index, entry in enumerate(value):
            try:
                if not isinstance(entry, TensorEntry):
                    raise SchemaError(ROOT, f"expected TensorEntry, got {type(entry).__name__}")
                check_fields(entry, TENSOR_SPEC)
                expected = math.prod(entry.shape) * SAFETENSORS_ITEMSIZE[entry.dtype]
                if entry.nbytes != expected:
                    raise SchemaError("nbytes", f"must be prod(shape) * itemsize = {expected}, got {entry.nbytes}")
            except SchemaError as exc:
                raise exc.nested(f"[{index}]") from None

    def to_wire(self, value: Any) -> list[dict[str, Any]]:
        return [fields_to_wire(entry, TENSOR_SPEC) for entry in value]

    def from_wire(self, raw: Any) -> Any:
        if not isinstance(raw, list):
            return raw
        entries = []
        for index, item in enumerate(raw):
            if not isinstance(item, dict):
                raise SchemaError(f"[{index}]", f"expected map, got {wire_type_name(item)}")
            try:
                entries.append(TensorEntry(**fields_from_wire(item, TENSOR_SPEC)))
            except SchemaError as exc:
                raise exc.nested(f"[{index}]") from None
        return entries


_ID, _PROMPT_ID, _COUNT, _TIME = Id(), Id(PROMPT_ID_MAX_LEN), Int(0), Float()
_PROMPT_TOKENS = Array("<i4", min_len=1, minimum=0)
_LOGPROBS = Array("<f4", finite=True, maximum=0.0)
_METADATA, _TIMINGS = StrMap(Str()), StrMap(Float())
_SHA256 = Pattern(SHA256_PATTERN, "sha256 hex digest")
_TOPIC = Pattern(TOPIC_PATTERN, "topic name")

SPECS: dict[type[Message], Spec] = {
    Prompt: (
        ("prompt_id", _PROMPT_ID), ("epoch", _COUNT), ("text", Str()), ("answer", Optional(Str())),
        ("metadata", _METADATA), ("group_size", Int(1, MAX_GROUP_SIZE)), ("attempt", _COUNT),
        ("prompt_token_ids", Optional(_PROMPT_TOKENS)), ("created_at", _TIME),
        ("messages", Added(Optional(MapList(StrMap(Str()))), None)),
    ),
    Rollout: (
        ("rollout_id", _ID), ("prompt_id", _PROMPT_ID), ("epoch", _COUNT), ("group_id", _ID),
        ("sample_index", _COUNT), ("group_size", Int(1)), ("prompt_token_ids", _PROMPT_TOKENS),
        ("response_token_ids", Array("<i4", min_len=1, minimum=0)), ("behavior_logprobs", _LOGPROBS),
        ("token_policy_versions", Array("<i8", minimum=0)), ("finish_reason", Enum(FINISH_REASONS)),
        ("producer_id", _ID), ("prompt_text", Str()), ("response_text", Str()), ("answer", Optional(Str())),
        ("metadata", _METADATA), ("attempt", _COUNT), ("temperature", Float(greater_than=0.0)),
        ("timings", _TIMINGS), ("policy_mask", Added(Optional(Array("|u1", minimum=0, maximum=1)), None)),
        ("turns", Added(Optional(MapList(StrMap(Str()))), None)),
    ),
    ScoredRollout: (
        ("rollout", Embedded(Rollout)), ("reward", Float()), ("reward_components", StrMap(Float())),
        ("token_rewards", Optional(Array("<f4", finite=True))), ("ref_logprobs", Optional(_LOGPROBS)),
        ("scorer_id", _ID), ("timings", _TIMINGS),
    ),
    WeightsManifest: (
        ("version", _COUNT), ("step", _COUNT), ("mode", Enum(WEIGHTS_MODES)), ("tensors", TensorList()),
        ("total_bytes", _COUNT), ("sha256", _SHA256), ("chunk_size", Int(1)), ("chunk_count", _COUNT),
        ("chunks_topic", Optional(_TOPIC)), ("store_uri", Optional(Str(nonempty=True))), ("created_at", _TIME),
        ("trainer_id", _ID), ("delta_base", Added(Optional(_COUNT), None)),
        ("delta_base_sha256", Added(Optional(_SHA256), None)), ("delta_bytes", Added(Optional(Int(1)), None)),
        ("delta_sha256", Added(Optional(_SHA256), None)), ("adapter_rank", Added(Optional(Int(1)), None)),
        ("adapter_alpha", Added(Optional(Float(greater_than=0.0)), None)),
    ),
    WeightsChunk: (
        ("version", _COUNT), ("index", _COUNT), ("count", Int(1)), ("data", Bytes(nonempty=True)),
        ("sha256", _SHA256),
    ),
    DeadLetter: (
        ("reason", Str(nonempty=True)), ("error_type", Str(nonempty=True)), ("source_topic", _TOPIC),
        ("source_partition", _COUNT), ("source_offset", _COUNT), ("raw_value", Optional(Bytes())),
        ("raw_key", Optional(Bytes())), ("consumer_id", _ID), ("created_at", _TIME),
        ("raw_size", Added(Optional(Int(0)), None)), ("raw_sha256", Added(Optional(_SHA256), None)),
        ("raw_truncated", Added(Bool(), False)),
    ),
    MemberRejected: (
        ("group_id", _ID), ("rollout_id", Optional(_ID)), ("attempt", Optional(_COUNT)),
        ("reason", Str(nonempty=True)), ("error_type", Str(nonempty=True)), ("source_topic", _TOPIC),
        ("source_partition", _COUNT), ("source_offset", _COUNT), ("consumer_id", _ID), ("created_at", _TIME),
    ),
    StaleRollout: (
        ("rollout_id", _ID), ("prompt_id", _PROMPT_ID), ("epoch", _COUNT), ("group_id", _ID),
        ("reason", Str(nonempty=True)), ("lag", _COUNT), ("max_lag", _COUNT), ("trainer_version", _COUNT),
        ("requeued", Bool()), ("created_at", _TIME),
    ),
    Heartbeat: (
        ("role", Enum(ROLES)), ("instance_id", _ID), ("host", Str(nonempty=True)), ("pid", _COUNT),
        ("state", Enum(ROLE_STATES)), ("policy_version", Int(-1)), ("step", _COUNT), ("rates", StrMap(Float())),
        ("metrics", StrMap(Float())), ("open_alerts", StrList()), ("interval_s", Float(greater_than=0.0)),
        ("created_at", _TIME),
    ),
    Alert: (
        ("name", Str(nonempty=True)), ("state", Enum(ALERT_STATES)), ("action", Enum(ALERT_ACTIONS)),
        ("role", Enum(ROLES)), ("instance_id", _ID), ("message", Str(nonempty=True)),
        ("value", Optional(Float())), ("threshold", Optional(Float())), ("created_at", _TIME),
    ),
    Evaluation: (
        ("version", _COUNT), ("step", _COUNT), ("sets", StrList()), ("metrics", StrMap(Float())),
        ("evaluator_id", _ID), ("elapsed_s", Float()), ("created_at", _TIME),
    ),
}
"""Field specs by message class, in dataclass field order (= wire order after ``kind``, ``schema_version``)."""


def _require_length(name: str, array: np.ndarray | None, length: int) -> None:
    if array is not None and array.shape[0] != length:
        raise SchemaError(name, f"length {array.shape[0]} != response length {length}")


def _require_group_id(msg: Rollout | StaleRollout) -> None:
    expected = group_id_for(msg.prompt_id, msg.epoch)
    if msg.group_id != expected:
        raise SchemaError("group_id", f"must be group_id_for(prompt_id, epoch) = {expected!r}, got {msg.group_id!r}")


def _rollout_rule(msg: Rollout) -> None:
    if msg.sample_index >= msg.group_size:
        raise SchemaError("sample_index", f"must be < group_size ({msg.group_size}), got {msg.sample_index}")
    length = msg.response_token_ids.shape[0]
    _require_length("behavior_logprobs", msg.behavior_logprobs, length)
    _require_length("token_policy_versions", msg.token_policy_versions, length)
    _require_group_id(msg)
    _turns_rule(msg, length)
    expected = rollout_id_for(msg.prompt_id, msg.epoch, msg.sample_index)
    if msg.rollout_id != expected:
        raise SchemaError("rollout_id", f"must be rollout_id_for(prompt_id, epoch, sample_index) = {expected!r}, "
                                        f"got {msg.rollout_id!r}")


def _turns_rule(msg: Rollout, length: int) -> None:
    """Multi-turn fields: both or neither; the mask covers the response and holds a policy token; one turn per
    run of the mask, its ``role`` matching the run."""
    if (msg.policy_mask is None) != (msg.turns is None):
        raise SchemaError("turns", "policy_mask and turns come together (both set for a multi-turn rollout, "
                                   "both absent otherwise)")
    if msg.policy_mask is None:
        return
    _require_length("policy_mask", msg.policy_mask, length)
    if not msg.policy_mask.any():
        raise SchemaError("policy_mask", "holds no policy token (at least one 1 is required)")
    runs = 1 + int(np.count_nonzero(np.diff(msg.policy_mask.astype(np.int8))))
    if len(msg.turns) != runs:
        raise SchemaError("turns", f"{len(msg.turns)} turn(s), but policy_mask has {runs} run(s)")
    starts = np.flatnonzero(np.diff(msg.policy_mask.astype(np.int8), prepend=np.int8(-1)))  # [runs]
    for index, start in enumerate(starts.tolist()):
        expected = "policy" if msg.policy_mask[start] else "env"
        if msg.turns[index].get("role") != expected:
            raise SchemaError(f"turns.{index}.role", f"must be {expected!r} (policy_mask[{start}] = "
                                                     f"{int(msg.policy_mask[start])}), got "
                                                     f"{msg.turns[index].get('role')!r}")


def _scored_rule(msg: ScoredRollout) -> None:
    length = msg.rollout.response_token_ids.shape[0]
    _require_length("token_rewards", msg.token_rewards, length)
    _require_length("ref_logprobs", msg.ref_logprobs, length)


def _manifest_rule(msg: WeightsManifest) -> None:
    seen: set[str] = set()
    end = 0
    for index, entry in enumerate(msg.tensors):
        if entry.name in seen:
            raise SchemaError(f"tensors[{index}].name", f"duplicate tensor name {entry.name!r:.80}")
        seen.add(entry.name)
        if entry.offset != end:
            raise SchemaError(f"tensors[{index}].offset", f"must be {end} (entries sorted by offset, contiguous, "
                                                          f"non-overlapping), got {entry.offset}")
        end = entry.end
    if msg.total_bytes != end:
        raise SchemaError("total_bytes", f"must equal the sum of tensor nbytes ({end}), got {msg.total_bytes}")
    _delta_rule(msg)
    if (msg.adapter_rank is None) != (msg.adapter_alpha is None):
        given, missing = ("adapter_rank", "adapter_alpha") if msg.adapter_alpha is None else ("adapter_alpha",
                                                                                              "adapter_rank")
        raise SchemaError(missing, f"required when {given} is set (a LoRA version names its rank and alpha)")
    sent = "delta_bytes" if msg.is_delta else "total_bytes"
    expected = chunk_count_for(msg.sent_bytes, msg.chunk_size)
    if msg.chunk_count != expected:
        raise SchemaError("chunk_count", f"must be ceil({sent} / chunk_size) = {expected}, "
                                         f"got {msg.chunk_count}")
    present, absent = ("chunks_topic", "store_uri") if msg.mode == "inline" else ("store_uri", "chunks_topic")
    if getattr(msg, present) is None:
        raise SchemaError(present, f"required in {msg.mode} mode")
    if getattr(msg, absent) is not None:
        raise SchemaError(absent, f"must be nil in {msg.mode} mode, got {getattr(msg, absent)!r:.80}")


_DELTA_FIELDS = ("delta_base", "delta_base_sha256", "delta_bytes", "delta_sha256")


def _delta_rule(msg: WeightsManifest) -> None:
    """The delta fields are all nil (a full snapshot) or all set, with a base older than the version."""
    given = [name for name in _DELTA_FIELDS if getattr(msg, name) is not None]
    if given and len(given) < len(_DELTA_FIELDS):
        missing = next(name for name in _DELTA_FIELDS if getattr(msg, name) is None)
        raise SchemaError(missing, f"required when {given[0]} is set (a delta names its base, its base's "
                                   f"sha256, its size and its sha256)")
    if msg.delta_base is not None and msg.delta_base >= msg.version:
        raise SchemaError("delta_base", f"must be below version {msg.version}, got {msg.delta_base}")


def _chunk_rule(msg: WeightsChunk) -> None:
    if msg.index >= msg.count:
        raise SchemaError("index", f"must be < count ({msg.count}), got {msg.index}")
    if getattr(msg, "_digest_of_data", False):  # WeightsChunk.from_data hashed these very bytes
        return
    digest = hashlib.sha256(msg.data).hexdigest()
    if msg.sha256 != digest:
        raise SchemaError("sha256", f"does not match data (data hashes to {digest})")


def _stale_rule(msg: StaleRollout) -> None:
    _require_group_id(msg)
    _require_member_id(msg.rollout_id, msg.group_id)


def _require_member_id(rollout_id: str, group_id: str) -> None:
    """``rollout_id`` must be ``rollout_id_for`` of some sample of ``group_id``: ``<group_id>:<i>``."""
    prefix = f"{group_id}:"
    if not (rollout_id.startswith(prefix) and is_decimal(rollout_id[len(prefix):])):
        raise SchemaError("rollout_id", f"must be rollout_id_for(prompt_id, epoch, i) = {prefix}<i>, "
                                        f"got {rollout_id!r}")


def _member_rejected_rule(msg: MemberRejected) -> None:
    if not is_group_id(msg.group_id):
        raise SchemaError("group_id", f"must be group_id_for(prompt_id, epoch) = <prompt_id>:<epoch>, got "
                                      f"{msg.group_id!r:.80}")
    if (msg.rollout_id is None) != (msg.attempt is None):
        raise SchemaError("attempt", "rollout_id and attempt are both set (a decoded rollout) or both nil")
    if msg.rollout_id is not None:
        _require_member_id(msg.rollout_id, msg.group_id)


def _dead_letter_rule(msg: DeadLetter) -> None:
    if msg.raw_value is None:
        for name in ("raw_size", "raw_sha256"):
            if getattr(msg, name) is not None:
                raise SchemaError(name, "must be nil when raw_value is nil")
        if msg.raw_truncated:
            raise SchemaError("raw_truncated", "must be false when raw_value is nil")
        return
    kept = len(msg.raw_value)
    if msg.raw_truncated:
        if msg.raw_size is None or msg.raw_size <= kept or msg.raw_sha256 is None:
            raise SchemaError("raw_truncated", f"needs raw_size > len(raw_value) ({kept}) and raw_sha256, got "
                                               f"raw_size {msg.raw_size}")
    elif msg.raw_size is not None and msg.raw_size != kept:
        raise SchemaError("raw_size", f"must equal len(raw_value) ({kept}) unless raw_truncated, got {msg.raw_size}")
    elif msg.raw_sha256 is not None and msg.raw_sha256 != hashlib.sha256(msg.raw_value).hexdigest():
        raise SchemaError("raw_sha256", "does not match raw_value")


def _evaluation_rule(msg: Evaluation) -> None:
    if not msg.sets:
        raise SchemaError("sets", "must name at least one evaluated set")
    if msg.elapsed_s < 0:
        raise SchemaError("elapsed_s", f"must be >= 0, got {msg.elapsed_s}")


def _no_rule(msg: Message) -> None:
    del msg


RULES: dict[type[Message], Callable[[Any], None]] = {
    Prompt: _no_rule, Rollout: _rollout_rule, ScoredRollout: _scored_rule, WeightsManifest: _manifest_rule,
    WeightsChunk: _chunk_rule, DeadLetter: _dead_letter_rule, StaleRollout: _stale_rule, Heartbeat: _no_rule,
    Alert: _no_rule, MemberRejected: _member_rejected_rule, Evaluation: _evaluation_rule,
}
"""Cross-field rule by message class, run after every field passed its own checks."""
