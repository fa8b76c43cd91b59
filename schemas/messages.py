"""The typed, versioned messages carried on the stream-rl topics, gathered in one place.

Consumes: nothing (plain data). Produces: one frozen, keyword-only dataclass per message kind, registered by kind
in :data:`MESSAGE_TYPES`. Each is declared once, by family, in :mod:`schemas.samples` (prompts, rollouts, scored
rollouts, rejected members), :mod:`schemas.weights` (manifests, tensor entries, chunks) and
:mod:`schemas.run_records` (dead letters, stale drops, heartbeats, alerts, evaluations): every field carries its
Python type, its wire type with its bounds and checks, and its default (:func:`schemas.declare.wire`); the field
specs and the kind registry are derived from those declarations. Every class has ``KIND`` and ``SCHEMA_VERSION``
class attributes; encoding, decoding and validation live in :mod:`schemas.codec`, the cross-field rules in
:mod:`schemas.validation`, the wire layout in ``docs/wire-format.md``.

Guarantees:
- Arrays are ``numpy.ndarray`` with a fixed dtype per field (token ids ``int32``, log-probabilities and per-token
  rewards ``float32``, policy versions ``int64``); a message is compared field by field, arrays by dtype, shape
  and values (``==``), so two messages with equal content are equal. Messages are not hashable.
- Mutable and time defaults come from ``default_factory``: every message gets its own dicts and its own
  ``created_at`` at construction, never one value shared from import time.
- "Frozen-ish": attributes cannot be reassigned (use ``dataclasses.replace``), but arrays and dicts inside are
  ordinary mutable objects; do not mutate a message after handing it to a producer.

Flow (see docs/architecture.md): ``Prompt`` -> producers -> ``Rollout`` -> scorers -> ``ScoredRollout`` (and a
``MemberRejected`` for each rollout a scorer dead-letters) -> trainer, which publishes ``WeightsManifest``
(+ ``WeightsChunk`` records in inline mode) and ``StaleRollout`` records;
any consumer writes ``DeadLetter`` records for input it cannot decode or validate; every role process publishes
``Heartbeat`` records (status topic) and ``Alert`` transitions (alerts topic); the evaluator publishes
``Evaluation`` records (evals topic); a producer whose batch stops before its long tail ends publishes
``PartialGroup`` records (partials topic, :mod:`schemas.partials`), which producers resume.
"""

from __future__ import annotations

from schemas.declare import MESSAGE_TYPES, Message

# Imported in flow order, which is the order the kinds register in MESSAGE_TYPES.
from schemas.samples import (  # isort: skip
    FINISH_REASONS, MAX_GROUP_SIZE, MemberRejected, Prompt, Rollout, ScoredRollout,
)
from schemas.weights import (  # isort: skip
    SAFETENSORS_ITEMSIZE, WEIGHTS_MODES, TensorEntry, WeightsChunk, WeightsManifest, chunk_count_for,
)
from schemas.run_records import (  # isort: skip
    ALERT_ACTIONS, ALERT_STATES, ROLE_STATES, ROLES, Alert, DeadLetter, Evaluation, Heartbeat, StaleRollout,
)
from schemas.gateway import GatewayCall, GatewayEpisode  # isort: skip
from schemas.partials import PARTIAL_FINISH_REASONS, PartialGroup  # isort: skip

__all__ = [
    "ALERT_ACTIONS", "ALERT_STATES", "FINISH_REASONS", "MAX_GROUP_SIZE", "MESSAGE_TYPES", "ROLES", "ROLE_STATES",
    "SAFETENSORS_ITEMSIZE", "WEIGHTS_MODES", "Alert", "DeadLetter", "Evaluation", "GatewayCall", "GatewayEpisode", "Heartbeat", "MemberRejected",
    "Message", "PARTIAL_FINISH_REASONS", "PartialGroup", "Prompt", "Rollout", "ScoredRollout", "StaleRollout", "TensorEntry", "WeightsChunk",
    "WeightsManifest", "chunk_count_for",
]
