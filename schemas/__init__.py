"""Typed, versioned wire messages of stream-rl and their msgpack codec (layout: docs/wire-format.md).

Consumes/produces: message objects <-> record value bytes. Guarantees: everything encoded was validated, everything
decoded is validated, and every problem is one :class:`SchemaError` naming the field.
"""

from schemas.arrays import WIRE_DTYPES, decode_array, encode_array, wire_dtype
from schemas.codec import decode, encode, message_kind, to_jsonable, validate
from schemas.errors import SchemaError
from schemas.ids import (
    ID_PATTERN, PROMPT_ID_MAX_LEN, SHA256_PATTERN, TOPIC_PATTERN, group_id_for, is_group_id, rollout_id_for,
)
from schemas.messages import (
    ALERT_ACTIONS, ALERT_STATES, MAX_GROUP_SIZE, MESSAGE_TYPES, ROLE_STATES, ROLES, SAFETENSORS_ITEMSIZE, Alert, DeadLetter,
    Evaluation, GatewayCall, GatewayEpisode, Heartbeat, MemberRejected, Message, PartialGroup, Prompt, Rollout, ScoredRollout, StaleRollout, TensorEntry, WeightsChunk, WeightsManifest,
    chunk_count_for,
)
from schemas.validation import FINISH_REASONS, WEIGHTS_MODES

__all__ = [
    "ALERT_ACTIONS", "ALERT_STATES", "Alert", "Heartbeat", "ROLES", "ROLE_STATES", "FINISH_REASONS", "ID_PATTERN", "MAX_GROUP_SIZE", "MESSAGE_TYPES", "PROMPT_ID_MAX_LEN", "SAFETENSORS_ITEMSIZE", "SHA256_PATTERN",
    "TOPIC_PATTERN", "WEIGHTS_MODES", "WIRE_DTYPES", "DeadLetter", "Evaluation", "GatewayCall", "GatewayEpisode", "MemberRejected", "Message", "PartialGroup", "Prompt", "Rollout", "SchemaError",
    "ScoredRollout", "StaleRollout", "TensorEntry", "WeightsChunk", "WeightsManifest", "chunk_count_for",
    "decode", "decode_array", "encode", "encode_array", "group_id_for", "is_group_id", "message_kind", "rollout_id_for",
    "to_jsonable", "validate", "wire_dtype",
]
