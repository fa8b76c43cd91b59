"""The run's bookkeeping messages: dead letters, stale drops, heartbeats, alerts and evaluations.

Consumes: nothing (plain data). Produces: :class:`DeadLetter`, :class:`StaleRollout`, :class:`Heartbeat`,
:class:`Alert` and :class:`Evaluation`, each declared once with :func:`~schemas.declare.message` (every field's
wire type, bounds and default on the field), and the enums their fields take. The cross-field rules are in
:mod:`schemas.validation`.

Guarantees: none of these records carries sample text except a dead letter's raw bytes; ``created_at`` and the
dict and list defaults are made per message; a dead letter built by :meth:`DeadLetter.of_value` describes the
whole value (size, digest) even when it keeps only its first bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

from schemas.declare import COUNT, ID, PROMPT_ID, SHA256, TIME, TOPIC, Message, message, now, wire
from schemas.fields import Bool, Bytes, Enum, Float, Int, Optional, Str, StrList, StrMap


@message
class DeadLetter(Message):
    """A consumed record that could not be decoded or validated. Dead-letter topic, key = the source record's key."""

    KIND: ClassVar[str] = "dead_letter"

    reason: str = wire(Str(nonempty=True))
    """Why the record was rejected (non-empty), e.g. ``str(SchemaError)``."""
    error_type: str = wire(Str(nonempty=True))
    """Class name of the error, e.g. ``SchemaError`` (non-empty)."""
    source_topic: str = wire(TOPIC)
    """Topic the record was read from."""
    source_partition: int = wire(COUNT)
    """Partition it was read from (>= 0)."""
    source_offset: int = wire(COUNT)
    """Its offset (>= 0)."""
    raw_value: bytes | None = wire(Optional(Bytes()))
    """The record's value as read, or its first bytes when ``raw_truncated``; ``None`` for a null value
    (tombstone) and for a record the client could not read at all (``error_type`` says why)."""
    raw_key: bytes | None = wire(Optional(Bytes()), default=None)
    """The record's key exactly as read, ``None`` when it had none."""
    consumer_id: str = wire(ID)
    """Id of the consumer that rejected it (``ID_PATTERN``)."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time the dead letter was written."""
    raw_size: int | None = wire(Optional(Int(0)), default=None, added=True)
    """Byte length of the whole value as read (>= 0); ``None`` when ``raw_value`` is ``None`` (added field:
    absent in older records, read as ``None``)."""
    raw_sha256: str | None = wire(Optional(SHA256), default=None, added=True)
    """SHA-256 (hex) of the whole value as read; ``None`` when ``raw_value`` is ``None`` (added field)."""
    raw_truncated: bool = wire(Bool(), default=False, added=True)
    """``raw_value`` holds only the first bytes of the value, so that the dead letter fits the producer's
    ``max_request_size``; the whole record stays at ``source_topic/partition/offset`` (added field)."""

    @classmethod
    def of_value(cls, value: bytes | None, max_raw_bytes: int, **fields: Any) -> DeadLetter:
        """A dead letter whose ``raw_*`` fields describe ``value``, keeping at most ``max_raw_bytes`` of it."""
        if value is None:
            return cls(raw_value=None, **fields)
        value = bytes(value)
        kept = value[:max(max_raw_bytes, 0)]
        return cls(raw_value=kept, raw_size=len(value), raw_sha256=hashlib.sha256(value).hexdigest(),
                   raw_truncated=len(kept) < len(value), **fields)


@message
class StaleRollout(Message):
    """A rollout the trainer dropped as too old, and whether its prompt was re-queued. The run's stale
    topic, key ``group_id``."""

    KIND: ClassVar[str] = "stale_rollout"

    rollout_id: str = wire(ID)
    """Id of the dropped rollout, ``rollout_id_for(prompt_id, epoch, i)`` for some sample index ``i``."""
    prompt_id: str = wire(PROMPT_ID)
    """Its prompt id."""
    epoch: int = wire(COUNT)
    """Its epoch (>= 0)."""
    group_id: str = wire(ID)
    """Must equal ``group_id_for(prompt_id, epoch)``."""
    reason: str = wire(Str(nonempty=True))
    """Why it was dropped (non-empty), e.g. ``lag 3 > max_lag 2``."""
    lag: int = wire(COUNT)
    """``trainer_version - rollout.min_policy_version`` at the time of the drop (>= 0)."""
    max_lag: int = wire(COUNT)
    """The configured staleness bound (>= 0)."""
    trainer_version: int = wire(COUNT)
    """Trainer policy version when it dropped the rollout (>= 0)."""
    requeued: bool = wire(Bool())
    """Whether the prompt was re-published (with ``attempt + 1``) to be regenerated."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time of the drop."""


ROLES = ("producer", "scorer", "trainer", "evaluator", "gateway", "driver")
"""The roles that publish heartbeats and alerts (``evaluator``, ``gateway`` and ``driver``: added values, the schema
version is unchanged; a reader built before them rejects such a heartbeat as invalid and skips it)."""
ROLE_STATES = ("starting", "ready", "paused", "stopping")
"""A role's state in its heartbeat: ``ready`` = ``/readyz`` answers 200; ``paused`` = an alert paused consuming."""
ALERT_STATES = ("firing", "resolved")
ALERT_ACTIONS = ("log", "pause", "stop")
"""What a firing alert does besides its record and log line: nothing more, stop consuming until it resolves, or
exit non-zero after a final checkpoint."""


@message
class Heartbeat(Message):
    """One role process saying it is alive, every ``telemetry.heartbeat_interval_s``. The run's status topic,
    key ``instance_id``. ``stream-rl status`` builds its view from these (the newest per instance)."""

    KIND: ClassVar[str] = "heartbeat"

    role: str = wire(Enum(ROLES))
    """One of :data:`ROLES`."""
    instance_id: str = wire(ID)
    """The process's transport instance id, e.g. ``trainer-1a2b3c4d`` (``ID_PATTERN``)."""
    host: str = wire(Str(nonempty=True))
    """Host name (non-empty)."""
    pid: int = wire(COUNT)
    """Process id (>= 0)."""
    state: str = wire(Enum(ROLE_STATES))
    """One of :data:`ROLE_STATES`."""
    policy_version: int = wire(Int(-1))
    """The weights version the process holds (trainer: trains at; producer: generates with); -1 = none yet."""
    step: int = wire(COUNT)
    """Trainer: optimizer steps done; producer and scorer: batches done (>= 0)."""
    rates: dict[str, float] = wire(StrMap(Float()), default_factory=dict)
    """Per-second rates over the last interval, e.g. ``records_in``, ``records_out``, ``tokens`` (finite)."""
    metrics: dict[str, float] = wire(StrMap(Float()), default_factory=dict)
    """Latest values worth showing: the trainer's last step metrics, ``lag/total``, ``process/rss_bytes`` (finite;
    non-finite values are left out)."""
    open_alerts: list[str] = wire(StrList(), default_factory=list)
    """Names of this process's alerts that are firing."""
    interval_s: float = wire(Float(greater_than=0.0), default=5.0)
    """Seconds until the next heartbeat; a reader treats an instance as gone after a few missed intervals."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time the heartbeat was sent."""


@message
class Alert(Message):
    """An alert firing or resolving. The run's alerts topic, key ``name``; also a log line."""

    KIND: ClassVar[str] = "alert"

    name: str = wire(Str(nonempty=True))
    """Alert rule name, e.g. ``loss_nonfinite``, ``consumer_lag`` (non-empty)."""
    state: str = wire(Enum(ALERT_STATES))
    """One of :data:`ALERT_STATES`."""
    action: str = wire(Enum(ALERT_ACTIONS))
    """One of :data:`ALERT_ACTIONS`: what the process does while it fires."""
    role: str = wire(Enum(ROLES))
    """One of :data:`ROLES`."""
    instance_id: str = wire(ID)
    """The process that raised it (``ID_PATTERN``)."""
    message: str = wire(Str(nonempty=True))
    """Human-readable: what was seen against which threshold (non-empty, never sample text)."""
    value: float | None = wire(Optional(Float()), default=None)
    """The observed value when finite (None for NaN/Inf or when not a number)."""
    threshold: float | None = wire(Optional(Float()), default=None)
    """The configured bound it crossed, when there is one."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time of the transition."""


@message
class Evaluation(Message):
    """One held-out evaluation of one policy version (``stream-rl evaluate``, the evaluator role). The run's evals
    topic, key ``str(version)``: a version is evaluated at most once, and a restarted evaluator reads the topic to
    learn which versions are done."""

    KIND: ClassVar[str] = "evaluation"

    version: int = wire(COUNT)
    """Policy version evaluated (>= 0; 0 = the initial weights)."""
    step: int = wire(COUNT)
    """Trainer step that produced the version (the manifest's ``step``; 0 for the initial weights)."""
    sets: list[str] = wire(StrList())
    """Names of the evaluated prompt sets (``eval.sets`` keys), in config order (non-empty)."""
    metrics: dict[str, float] = wire(StrMap(Float()))
    """``<set>/<metric>`` and ``<set>/<source>/<metric>`` values (finite), e.g. ``heldout/pass@8``,
    ``heldout/greedy/accuracy`` (names: docs/evaluation.md)."""
    evaluator_id: str = wire(ID)
    """The evaluator process's id (``ID_PATTERN``)."""
    elapsed_s: float = wire(Float(), default=0.0)
    """Seconds the evaluation took (generation and scoring, >= 0)."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time the record was created."""
