"""The typed, versioned messages carried on the stream-rl topics.

Consumes: nothing (plain data). Produces: one frozen, keyword-only dataclass per message kind, registered by kind
in :data:`MESSAGE_TYPES`. Every class has ``KIND`` and ``SCHEMA_VERSION`` class attributes; encoding, decoding and
validation live in :mod:`schemas.codec`, the rules in :mod:`schemas.validation`, the wire layout in
``docs/wire-format.md``.

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
``Evaluation`` records (evals topic).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from schemas.ids import group_id_for


def _now() -> float:
    return time.time()


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool(np.array_equal(a, b)))
    return bool(a == b)


class Message:
    """Base of every wire message: a ``KIND`` string and a ``SCHEMA_VERSION``; equality field by field."""

    KIND: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 1

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_values_equal(getattr(self, f.name), getattr(other, f.name))
                   for f in dataclasses.fields(self))  # type: ignore[arg-type]

    __hash__ = None  # type: ignore[assignment]


MAX_GROUP_SIZE = 65_536
"""Largest ``Prompt.group_size`` (the producer's ``max_group_size`` cannot be set higher)."""


@dataclass(frozen=True, eq=False, kw_only=True)
class Prompt(Message):
    """One prompt of one epoch, to be answered by a group of samples. Prompts topic, key ``prompt_id``."""

    KIND: ClassVar[str] = "prompt"

    prompt_id: str
    """Stable id of the prompt across epochs (``ID_PATTERN``, at most 200 characters)."""
    epoch: int
    """Pass over the prompt set this record belongs to (>= 0)."""
    text: str
    """The prompt exactly as the policy reads it: a plain ``text`` prompt as written in the prompt file, or, for a
    conversational prompt, its ``messages`` rendered by the policy tokenizer's chat template when the prompts were
    loaded (``stream-rl prompts load`` / ``run``; ``prompt_token_ids`` then holds the rendered ids)."""
    answer: str | None = None
    """Reference answer for verifiable tasks, read by rule-based rewards; ``None`` when there is none."""
    metadata: dict[str, str] = field(default_factory=dict)
    """Free-form string tags (task name, source, difficulty), copied onto every rollout."""
    group_size: int
    """Samples wanted for this prompt, ``1 <= group_size <= MAX_GROUP_SIZE``: the group of GRPO-style
    advantage estimators."""
    attempt: int = 0
    """How many times this (prompt, epoch) was re-queued after a stale drop (0 for the first load)."""
    prompt_token_ids: np.ndarray | None = None
    """Optional pre-tokenised prompt, int32 ``[P]``, ``P >= 1``, ids >= 0; ``None``: the producer tokenises."""
    created_at: float = field(default_factory=_now)
    """Unix time (seconds) the record was created."""
    messages: list[dict[str, str]] | None = None
    """The conversation as loaded (OpenAI format: ``role`` in system/user/assistant/tool, ``content``), for a
    conversational prompt; ``None`` for a plain ``text`` prompt. Multi-turn environments continue it on the chat
    template; ``text`` and ``prompt_token_ids`` are its rendering."""

    @property
    def group_id(self) -> str:
        """The group id every sample of this prompt and epoch will carry."""
        return group_id_for(self.prompt_id, self.epoch)


@dataclass(frozen=True, eq=False, kw_only=True)
class Rollout(Message):
    """One sampled response with what the trainer needs to correct for off-policy sampling.

    Rollouts topic, key ``group_id`` (a group stays on one partition). ``R = len(response_token_ids) >= 1``.
    """

    KIND: ClassVar[str] = "rollout"

    rollout_id: str
    """Deterministic id, must equal ``rollout_id_for(prompt_id, epoch, sample_index)``; the dedup key."""
    prompt_id: str
    """Id of the prompt this samples (``ID_PATTERN``, at most 200 characters)."""
    epoch: int
    """Epoch of the prompt (>= 0)."""
    group_id: str
    """Must equal ``group_id_for(prompt_id, epoch)``; independent of the attempt."""
    sample_index: int
    """Position of this sample in its group, ``0 <= sample_index < group_size``."""
    group_size: int
    """Number of samples in the group (>= 1)."""
    prompt_token_ids: np.ndarray
    """Prompt tokens as the policy saw them, int32 ``[P]``, ``P >= 1``, ids >= 0."""
    response_token_ids: np.ndarray
    """Sampled tokens, int32 ``[R]``, ``R >= 1``, ids >= 0 (including the stop token when one was sampled)."""
    behavior_logprobs: np.ndarray
    """log mu(token) under the distribution actually sampled, float32 ``[R]``, finite, <= 0 (exactly 0.0 allowed:
    float32 rounding of log 1): ``log softmax(logits / temperature)`` truncated by the producer's min-p, top-k and
    top-p and renormalised over the kept tokens (the full tempered softmax when none is set; docs/algorithms.md,
    "Sampling controls")."""
    token_policy_versions: np.ndarray
    """Policy (weights) version that produced each token, int64 ``[R]``, >= 0."""
    finish_reason: str
    """Why generation ended: ``"stop"`` (stop token or string), ``"length"`` (token budget), ``"abort"``."""
    producer_id: str
    """Id of the producer process that generated the sample (``ID_PATTERN``)."""
    prompt_text: str
    """The prompt text (redacted by ``stream-rl replay`` unless ``--show-text``)."""
    response_text: str
    """The detokenised response (redacted by ``stream-rl replay`` unless ``--show-text``)."""
    answer: str | None = None
    """Reference answer copied from the prompt, ``None`` when there is none."""
    metadata: dict[str, str] = field(default_factory=dict)
    """String tags copied from the prompt."""
    attempt: int = 0
    """Attempt of the prompt this was generated for (>= 0); not part of any id."""
    temperature: float
    """Sampling temperature, finite and > 0; the trainer divides logits by it before log-softmax."""
    timings: dict[str, float] = field(default_factory=dict)
    """Finite floats, seconds or Unix times, e.g. ``generate_s``, ``created_at``, ``queue_wait_s``."""
    policy_mask: np.ndarray | None = None
    """Multi-turn: uint8 ``[R]``, 1 where the policy sampled the token (it gets loss, its behaviour logprob and
    version are real), 0 for environment or tool output inserted between turns (``behavior_logprobs`` 0 there).
    ``None``: every token is the policy's (a single-turn rollout)."""
    turns: list[dict[str, str]] | None = None
    """Multi-turn: one string-tag map per turn in order (``{"role": "policy"}`` or ``{"role": "env", ...}``), one
    turn per run of equal values of ``policy_mask``. ``None`` with ``policy_mask``."""

    @property
    def response_length(self) -> int:
        """``R``, the number of response tokens."""
        return int(self.response_token_ids.shape[0])

    @property
    def min_policy_version(self) -> int:
        """Oldest policy version among the response tokens: the one staleness is measured from."""
        return int(self.token_policy_versions.min())

    @property
    def max_policy_version(self) -> int:
        """Newest policy version among the response tokens."""
        return int(self.token_policy_versions.max())


@dataclass(frozen=True, eq=False, kw_only=True)
class ScoredRollout(Message):
    """A rollout with its rewards and reference log-probabilities. Scored topic, key ``rollout.group_id``."""

    KIND: ClassVar[str] = "scored_rollout"

    rollout: Rollout
    """The scored rollout, embedded whole and validated as a rollout record."""
    reward: float
    """Sequence-level reward (finite): the sum of the components as the scorer defines it."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """Named finite parts of the reward, e.g. ``{"correct": 1.0, "format": 0.1}``, for metrics."""
    token_rewards: np.ndarray | None = None
    """Optional token-level rewards, float32 ``[R]``, finite."""
    ref_logprobs: np.ndarray | None = None
    """Optional log pi_ref(token) of the frozen reference model, float32 ``[R]``, finite, <= 0."""
    scorer_id: str
    """Id of the scorer process (``ID_PATTERN``)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Finite floats, e.g. ``score_s``, ``ref_logprobs_s``, ``created_at``."""

    @property
    def rollout_id(self) -> str:
        """The embedded rollout's id."""
        return self.rollout.rollout_id

    @property
    def group_id(self) -> str:
        """The embedded rollout's group id (the record key)."""
        return self.rollout.group_id


@dataclass(frozen=True, eq=False, kw_only=True)
class MemberRejected(Message):
    """A member of a group that a consumer dead-lettered, so the group can never complete. Scored topic, key
    ``group_id``: it follows the group's other members on their partition, and the trainer drops the group at
    once (its buffered members to the stale topic, its prompt re-queued) instead of holding its partition's safe
    offset until the group goes stale. Its dead letter, with the record itself, is on the dlq topic."""

    KIND: ClassVar[str] = "member_rejected"

    group_id: str
    """The group (``group_id_for(prompt_id, epoch)``): the rejected record's ``group_id``, or its key when its
    value could not be decoded."""
    rollout_id: str | None = None
    """The rejected rollout's id; ``None`` when its value could not be decoded."""
    attempt: int | None = None
    """The rejected rollout's attempt (>= 0); ``None`` when its value could not be decoded."""
    reason: str
    """Why it was rejected (non-empty), as in its dead letter."""
    error_type: str
    """Class name of the error, as in its dead letter (non-empty)."""
    source_topic: str
    """Topic the rejected record was read from."""
    source_partition: int
    """Its partition (>= 0)."""
    source_offset: int
    """Its offset (>= 0)."""
    consumer_id: str
    """Id of the consumer that rejected it (``ID_PATTERN``)."""
    created_at: float = field(default_factory=_now)
    """Unix time of the rejection."""


SAFETENSORS_ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
"""Bytes per element of each safetensors dtype name a manifest may use."""


@dataclass(frozen=True, eq=True, kw_only=True)
class TensorEntry:
    """Where one tensor lies in the flat weights payload (part of a :class:`WeightsManifest`)."""

    name: str
    """Parameter name as in the model's state dict, e.g. ``model.layers.0.mlp.up_proj.weight``; unique."""
    dtype: str
    """safetensors dtype name: ``F32``, ``BF16``, ``F16``, ``I64`` ... (see :data:`SAFETENSORS_ITEMSIZE`)."""
    shape: tuple[int, ...]
    """Tensor shape; a list is accepted and stored as a tuple."""
    offset: int
    """Byte offset of the tensor's first byte in the payload."""
    nbytes: int
    """Byte length: ``prod(shape) * itemsize(dtype)``; raw little-endian, C order."""

    def __post_init__(self) -> None:
        if isinstance(self.shape, list):
            object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def end(self) -> int:
        """Offset one past the tensor's last byte."""
        return self.offset + self.nbytes


def chunk_count_for(total_bytes: int, chunk_size: int) -> int:
    """``ceil(total_bytes / chunk_size)``: chunks needed to carry a payload."""
    return -(-total_bytes // chunk_size)


@dataclass(frozen=True, eq=False, kw_only=True)
class WeightsManifest(Message):
    """Announces policy version ``version``: what the payload holds and where to fetch it.

    Weights topic, key ``str(version)``. Payload = the tensors' raw bytes concatenated in ``tensors`` order.
    Inline mode: the payload comes as ``chunk_count`` :class:`WeightsChunk` records on ``chunks_topic``, chunk ``i``
    holding ``payload[i * chunk_size : (i + 1) * chunk_size]``. Store mode: a safetensors file at ``store_uri``.
    A delta version (``delta_base`` set) sends its compressed delta the same way instead (chunks, or a raw file at
    ``store_uri``); the receiver rebuilds the payload and checks it against ``sha256`` before use.
    """

    KIND: ClassVar[str] = "weights_manifest"

    version: int
    """Policy version published (>= 0); rollouts carry it in ``token_policy_versions``."""
    step: int
    """Trainer optimiser step after which the weights were taken (>= 0)."""
    mode: str
    """``"inline"`` (chunks on a per-version topic) or ``"store"`` (file in a weights store)."""
    tensors: list[TensorEntry]
    """At least one entry, sorted by offset, contiguous from 0, no overlaps, unique names."""
    total_bytes: int
    """Payload size, equal to the sum of the entries' ``nbytes``."""
    sha256: str
    """SHA-256 of the whole payload, 64 lowercase hex characters."""
    chunk_size: int
    """Bytes per chunk (>= 1); the last chunk may be shorter."""
    chunk_count: int
    """``ceil(total_bytes / chunk_size)``, in both modes."""
    chunks_topic: str | None = None
    """Inline mode: the Kafka topic holding the chunks; must be ``None`` in store mode."""
    store_uri: str | None = None
    """Store mode: where the safetensors file is (path or URI); must be ``None`` in inline mode."""
    created_at: float = field(default_factory=_now)
    """Unix time the manifest was written, after the payload was durable."""
    trainer_id: str
    """Id of the trainer that published the version (``ID_PATTERN``)."""
    delta_base: int | None = None
    """``None``: a full snapshot (what is sent is the payload). Otherwise a delta: what is sent (chunks or the
    store file) is ``zlib(payload XOR payload of version delta_base)``, and ``delta_base < version``."""
    delta_base_sha256: str | None = None
    """Delta: the ``sha256`` of version ``delta_base``'s payload (which base the delta applies to)."""
    delta_bytes: int | None = None
    """Delta: size of the compressed delta that is sent; ``chunk_count`` counts its chunks."""
    delta_sha256: str | None = None
    """Delta: SHA-256 of the compressed delta. ``sha256`` stays the digest of the rebuilt payload."""
    adapter_rank: int | None = None
    """``None``: the tensors are the policy's weights. Otherwise a LoRA adapter version (``trainer.lora``): the
    tensors are ``{module}.lora_A.weight`` ``[r, in]`` and ``{module}.lora_B.weight`` ``[out, r]`` of a frozen base
    (the producers' own model directory), applied as ``W = W0 + (adapter_alpha / adapter_rank) * B A``."""
    adapter_alpha: float | None = None
    """LoRA alpha (> 0); set exactly when ``adapter_rank`` is."""

    @property
    def is_delta(self) -> bool:
        return self.delta_base is not None

    @property
    def is_adapter(self) -> bool:
        return self.adapter_rank is not None

    @property
    def sent_bytes(self) -> int:
        """Bytes that travel for this version: the delta's size for a delta, else the payload's."""
        return self.delta_bytes if self.delta_bytes is not None else self.total_bytes

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of chunk ``index`` in what is sent (the payload, or the delta)."""
        if not 0 <= index < self.chunk_count:
            raise IndexError(f"chunk {index} out of range 0..{self.chunk_count - 1}")
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.sent_bytes)


@dataclass(frozen=True, eq=False, kw_only=True)
class WeightsChunk(Message):
    """One slice of an inline weights payload. Topic ``manifest.chunks_topic``, key ``str(version)``."""

    KIND: ClassVar[str] = "weights_chunk"

    version: int
    """Policy version the chunk belongs to (>= 0)."""
    index: int
    """Chunk position, ``0 <= index < count``."""
    count: int
    """Number of chunks of the version (>= 1), equal to the manifest's ``chunk_count``."""
    data: bytes
    """The chunk's bytes (non-empty)."""
    sha256: str
    """SHA-256 of ``data``, 64 lowercase hex characters; checked on decode."""

    @classmethod
    def from_data(cls, *, version: int, index: int, count: int, data: bytes) -> WeightsChunk:
        """A chunk with its digest computed. The chunk remembers that its digest was computed from its own
        (immutable) bytes, so validating it before sending does not hash them again; a chunk built any other way,
        decoded ones included, is hashed when validated."""
        chunk = cls(version=version, index=index, count=count, data=data, sha256=hashlib.sha256(data).hexdigest())
        if type(data) is bytes:  # immutable: the digest cannot go stale (the dataclass is frozen too)
            object.__setattr__(chunk, "_digest_of_data", True)
        return chunk


@dataclass(frozen=True, eq=False, kw_only=True)
class DeadLetter(Message):
    """A consumed record that could not be decoded or validated. Dead-letter topic, key = the source record's key."""

    KIND: ClassVar[str] = "dead_letter"

    reason: str
    """Why the record was rejected (non-empty), e.g. ``str(SchemaError)``."""
    error_type: str
    """Class name of the error, e.g. ``SchemaError`` (non-empty)."""
    source_topic: str
    """Topic the record was read from."""
    source_partition: int
    """Partition it was read from (>= 0)."""
    source_offset: int
    """Its offset (>= 0)."""
    raw_value: bytes | None
    """The record's value as read, or its first bytes when ``raw_truncated``; ``None`` for a null value
    (tombstone) and for a record the client could not read at all (``error_type`` says why)."""
    raw_key: bytes | None = None
    """The record's key exactly as read, ``None`` when it had none."""
    consumer_id: str
    """Id of the consumer that rejected it (``ID_PATTERN``)."""
    created_at: float = field(default_factory=_now)
    """Unix time the dead letter was written."""
    raw_size: int | None = None
    """Byte length of the whole value as read (>= 0); ``None`` when ``raw_value`` is ``None`` (added field:
    absent in older records, read as ``None``)."""
    raw_sha256: str | None = None
    """SHA-256 (hex) of the whole value as read; ``None`` when ``raw_value`` is ``None`` (added field)."""
    raw_truncated: bool = False
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


@dataclass(frozen=True, eq=False, kw_only=True)
class StaleRollout(Message):
    """A rollout the trainer dropped as too old, and whether its prompt was re-queued. The run's stale
    topic, key ``group_id``."""

    KIND: ClassVar[str] = "stale_rollout"

    rollout_id: str
    """Id of the dropped rollout, ``rollout_id_for(prompt_id, epoch, i)`` for some sample index ``i``."""
    prompt_id: str
    """Its prompt id."""
    epoch: int
    """Its epoch (>= 0)."""
    group_id: str
    """Must equal ``group_id_for(prompt_id, epoch)``."""
    reason: str
    """Why it was dropped (non-empty), e.g. ``lag 3 > max_lag 2``."""
    lag: int
    """``trainer_version - rollout.min_policy_version`` at the time of the drop (>= 0)."""
    max_lag: int
    """The configured staleness bound (>= 0)."""
    trainer_version: int
    """Trainer policy version when it dropped the rollout (>= 0)."""
    requeued: bool
    """Whether the prompt was re-published (with ``attempt + 1``) to be regenerated."""
    created_at: float = field(default_factory=_now)
    """Unix time of the drop."""


ROLES = ("producer", "scorer", "trainer", "evaluator")
"""The roles that publish heartbeats and alerts (``evaluator``: added value, the schema version is unchanged; a
reader built before it rejects such a heartbeat as invalid and skips it)."""
ROLE_STATES = ("starting", "ready", "paused", "stopping")
"""A role's state in its heartbeat: ``ready`` = ``/readyz`` answers 200; ``paused`` = an alert paused consuming."""
ALERT_STATES = ("firing", "resolved")
ALERT_ACTIONS = ("log", "pause", "stop")
"""What a firing alert does besides its record and log line: nothing more, stop consuming until it resolves, or
exit non-zero after a final checkpoint."""


@dataclass(frozen=True, eq=False, kw_only=True)
class Heartbeat(Message):
    """One role process saying it is alive, every ``telemetry.heartbeat_interval_s``. The run's status topic,
    key ``instance_id``. ``stream-rl status`` builds its view from these (the newest per instance)."""

    KIND: ClassVar[str] = "heartbeat"

    role: str
    """One of :data:`ROLES`."""
    instance_id: str
    """The process's transport instance id, e.g. ``trainer-1a2b3c4d`` (``ID_PATTERN``)."""
    host: str
    """Host name (non-empty)."""
    pid: int
    """Process id (>= 0)."""
    state: str
    """One of :data:`ROLE_STATES`."""
    policy_version: int
    """The weights version the process holds (trainer: trains at; producer: generates with); -1 = none yet."""
    step: int
    """Trainer: optimizer steps done; producer and scorer: batches done (>= 0)."""
    rates: dict[str, float] = field(default_factory=dict)
    """Per-second rates over the last interval, e.g. ``records_in``, ``records_out``, ``tokens`` (finite)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Latest values worth showing: the trainer's last step metrics, ``lag/total``, ``process/rss_bytes`` (finite;
    non-finite values are left out)."""
    open_alerts: list[str] = field(default_factory=list)
    """Names of this process's alerts that are firing."""
    interval_s: float = 5.0
    """Seconds until the next heartbeat; a reader treats an instance as gone after a few missed intervals."""
    created_at: float = field(default_factory=_now)
    """Unix time the heartbeat was sent."""


@dataclass(frozen=True, eq=False, kw_only=True)
class Alert(Message):
    """An alert firing or resolving. The run's alerts topic, key ``name``; also a log line."""

    KIND: ClassVar[str] = "alert"

    name: str
    """Alert rule name, e.g. ``loss_nonfinite``, ``consumer_lag`` (non-empty)."""
    state: str
    """One of :data:`ALERT_STATES`."""
    action: str
    """One of :data:`ALERT_ACTIONS`: what the process does while it fires."""
    role: str
    """One of :data:`ROLES`."""
    instance_id: str
    """The process that raised it (``ID_PATTERN``)."""
    message: str
    """Human-readable: what was seen against which threshold (non-empty, never sample text)."""
    value: float | None = None
    """The observed value when finite (None for NaN/Inf or when not a number)."""
    threshold: float | None = None
    """The configured bound it crossed, when there is one."""
    created_at: float = field(default_factory=_now)
    """Unix time of the transition."""


@dataclass(frozen=True, eq=False, kw_only=True)
class Evaluation(Message):
    """One held-out evaluation of one policy version (``stream-rl evaluate``, the evaluator role). The run's evals
    topic, key ``str(version)``: a version is evaluated at most once, and a restarted evaluator reads the topic to
    learn which versions are done."""

    KIND: ClassVar[str] = "evaluation"

    version: int
    """Policy version evaluated (>= 0; 0 = the initial weights)."""
    step: int
    """Trainer step that produced the version (the manifest's ``step``; 0 for the initial weights)."""
    sets: list[str]
    """Names of the evaluated prompt sets (``eval.sets`` keys), in config order (non-empty)."""
    metrics: dict[str, float]
    """``<set>/<metric>`` and ``<set>/<source>/<metric>`` values (finite), e.g. ``heldout/pass@8``,
    ``heldout/greedy/accuracy`` (names: docs/evaluation.md)."""
    evaluator_id: str
    """The evaluator process's id (``ID_PATTERN``)."""
    elapsed_s: float = 0.0
    """Seconds the evaluation took (generation and scoring, >= 0)."""
    created_at: float = field(default_factory=_now)
    """Unix time the record was created."""


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (Prompt, Rollout, ScoredRollout, MemberRejected, WeightsManifest, WeightsChunk, DeadLetter,
                StaleRollout, Heartbeat, Alert, Evaluation)
}
"""Registry: wire ``kind`` -> message class."""
