"""The cross-field rules of every message kind, and the derived field specs.

Consumes: message objects (``check_message``, ``message_to_wire``) or msgpack-decoded maps
(``read_envelope``, ``message_from_wire``). Produces: validated messages or wire maps; errors as
:class:`SchemaError` naming the field relative to the message (the codec attributes the kind).

Guarantees:
- Each field's type, bounds and checks are declared once, on the message dataclass (:func:`schemas.declare.wire`);
  :data:`SPECS` (class -> ``(name, FieldType)`` pairs in dataclass order) is derived from those declarations, not
  written here. Every declared field is required on the wire, except fields added after version 1
  (``wire(..., added=True)``, an :class:`~schemas.fields.Added` in the spec), which read as their default when
  absent; fields not declared are ignored on read (forward compatibility).
- The same rules run before encoding and after decoding, so whatever ``encode`` writes ``decode`` accepts
  (decoding runs each field's conversion and checks in one pass, ``read_fields``, then the cross-field rule).
- Cross-field rules (:data:`RULES`, one per kind, checked at import): lengths of per-token arrays agree with the
  response, ``sample_index < group_size``, ids are the deterministic ones, a manifest's tensors tile the payload
  exactly and its chunk count and mode fields agree, a chunk's digest matches its bytes, a dead letter's
  ``raw_size`` / ``raw_sha256`` / ``raw_truncated`` agree with its ``raw_value``.
"""

from __future__ import annotations

import hashlib

import numpy as np

from schemas.declare import (
    MESSAGE_TYPES, RULES, SPECS, Embedded, check_message, message_from_wire, message_to_wire, read_envelope,
)
from schemas.errors import SchemaError
from schemas.ids import group_id_for, is_decimal, is_group_id, rollout_id_for
from schemas.messages import (
    FINISH_REASONS, WEIGHTS_MODES, Alert, DeadLetter, Evaluation, Heartbeat, MemberRejected, Message, Prompt, Rollout,
    ScoredRollout, StaleRollout, WeightsChunk, WeightsManifest, chunk_count_for,
)
from schemas.weights import TENSOR_SPEC, TensorList
from schemas.gateway import GatewayCall, GatewayEpisode  # isort: skip
from schemas.partials import PARTIAL_FINISH_REASONS, PartialGroup  # isort: skip

__all__ = [
    "FINISH_REASONS", "RULES", "SPECS", "TENSOR_SPEC", "WEIGHTS_MODES", "Embedded", "TensorList", "check_message",
    "message_from_wire", "message_to_wire", "read_envelope",
]


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
    turns = msg.turns if msg.turns is not None else []  # set: checked together with policy_mask above
    if not msg.policy_mask.any():
        raise SchemaError("policy_mask", "holds no policy token (at least one 1 is required)")
    runs = 1 + int(np.count_nonzero(np.diff(msg.policy_mask.astype(np.int8))))
    if len(turns) != runs:
        raise SchemaError("turns", f"{len(turns)} turn(s), but policy_mask has {runs} run(s)")
    starts = np.flatnonzero(np.diff(msg.policy_mask.astype(np.int8), prepend=np.int8(-1)))  # [runs]
    for index, start in enumerate(starts.tolist()):
        expected = "policy" if msg.policy_mask[start] else "env"
        if turns[index].get("role") != expected:
            raise SchemaError(f"turns.{index}.role", f"must be {expected!r} (policy_mask[{start}] = "
                                                     f"{int(msg.policy_mask[start])}), got "
                                                     f"{turns[index].get('role')!r}")


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


def _gateway_call_rule(msg: GatewayCall) -> None:
    length = msg.response_token_ids.shape[0]
    _require_length("behavior_logprobs", msg.behavior_logprobs, length)
    _require_length("token_policy_versions", msg.token_policy_versions, length)


def _gateway_episode_rule(msg: GatewayEpisode) -> None:
    if (msg.outcome == "dead_lettered") != bool(msg.reason):
        raise SchemaError("reason", "must be non-empty exactly when outcome is 'dead_lettered'")
    if msg.refill and msg.outcome != "dead_lettered":
        raise SchemaError("refill", f"may be true only when outcome is 'dead_lettered', got {msg.outcome!r}")
    if msg.refill and not msg.episode_id.rpartition("/")[0]:  # as producers.gateway.episodes.group_of reads it
        raise SchemaError("refill", f"needs an episode of a group (GROUP/NAME), got {msg.episode_id!r}")


def _partial_rule(msg: PartialGroup) -> None:
    if msg.group_id != msg.prompt.group_id:
        raise SchemaError("group_id", f"must equal the prompt's group_id {msg.prompt.group_id!r}, got {msg.group_id!r}")
    size = msg.sample_lengths.shape[0]
    if len(msg.finish_reasons) != size:
        raise SchemaError("finish_reasons", f"must have one entry per sample ({size}), got {len(msg.finish_reasons)}")
    bad = [r for r in msg.finish_reasons if r not in PARTIAL_FINISH_REASONS]
    if bad:
        raise SchemaError("finish_reasons", f"must be one of {PARTIAL_FINISH_REASONS}, got {bad[0]!r:.40}")
    if "cut" not in msg.finish_reasons:
        raise SchemaError("finish_reasons", "at least one sample must be 'cut' (a group with none is complete)")
    total = int(msg.sample_lengths.sum())
    _require_length("token_ids", msg.token_ids, total)
    _require_length("behavior_logprobs", msg.behavior_logprobs, total)
    _require_length("token_policy_versions", msg.token_policy_versions, total)


def _no_rule(msg: Message) -> None:
    del msg


RULES.update({
    Prompt: _no_rule, Rollout: _rollout_rule, ScoredRollout: _scored_rule, WeightsManifest: _manifest_rule,
    WeightsChunk: _chunk_rule, DeadLetter: _dead_letter_rule, StaleRollout: _stale_rule, Heartbeat: _no_rule,
    Alert: _no_rule, MemberRejected: _member_rejected_rule, Evaluation: _evaluation_rule,
    GatewayCall: _gateway_call_rule, GatewayEpisode: _gateway_episode_rule, PartialGroup: _partial_rule,
})


def require_a_rule_per_kind() -> None:
    """Raise ``TypeError`` naming every registered message class without a cross-field rule (run at import)."""
    unruled = [cls.__qualname__ for cls in MESSAGE_TYPES.values() if cls not in RULES]
    if unruled:
        raise TypeError(f"no cross-field rule for {', '.join(unruled)}: add it to schemas.validation.RULES "
                        f"(_no_rule when it has none)")


require_a_rule_per_kind()
