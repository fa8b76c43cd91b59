"""The sample path's messages: prompts, rollouts, scored rollouts, and the rejection of a group member.

Consumes: nothing (plain data). Produces: :class:`Prompt`, :class:`Rollout`, :class:`ScoredRollout` and
:class:`MemberRejected`, each declared once with :func:`~schemas.declare.message`: every field carries its Python
type, its wire type (bounds and checks included) and its default on one line; the cross-field rules are in
:mod:`schemas.validation`.

Guarantees: as for every message (:mod:`schemas.messages`): frozen, keyword-only, compared field by field with
arrays by dtype, shape and values; per-token arrays have the dtype their field declares; ``created_at`` and the
dict defaults are made per message.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from schemas.declare import COUNT, ID, PROMPT_ID, TIME, TOPIC, Embedded, Message, message, now, wire
from schemas.fields import Array, Enum, Float, Int, MapList, Optional, Str, StrMap
from schemas.ids import group_id_for

FINISH_REASONS = ("stop", "length", "abort")
"""Why generation ended, as a rollout's ``finish_reason``."""

_PROMPT_TOKENS = Array("<i4", min_len=1, minimum=0)  # token ids [P], P >= 1
_LOGPROBS = Array("<f4", finite=True, maximum=0.0)  # log-probabilities [R]
_METADATA, _TIMINGS = StrMap(Str()), StrMap(Float())

MAX_GROUP_SIZE = 65_536
"""Largest ``Prompt.group_size`` (the producer's ``max_group_size`` cannot be set higher)."""


@message
class Prompt(Message):
    """One prompt of one epoch, to be answered by a group of samples. Prompts topic, key ``prompt_id``."""

    KIND: ClassVar[str] = "prompt"

    prompt_id: str = wire(PROMPT_ID)
    """Stable id of the prompt across epochs (``ID_PATTERN``, at most 200 characters)."""
    epoch: int = wire(COUNT)
    """Pass over the prompt set this record belongs to (>= 0)."""
    text: str = wire(Str())
    """The prompt exactly as the policy reads it: a plain ``text`` prompt as written in the prompt file, or, for a
    conversational prompt, its ``messages`` rendered by the policy tokenizer's chat template when the prompts were
    loaded (``stream-rl prompts load`` / ``run``; ``prompt_token_ids`` then holds the rendered ids)."""
    answer: str | None = wire(Optional(Str()), default=None)
    """Reference answer for verifiable tasks, read by rule-based rewards; ``None`` when there is none."""
    metadata: dict[str, str] = wire(_METADATA, default_factory=dict)
    """Free-form string tags (task name, source, difficulty), copied onto every rollout."""
    group_size: int = wire(Int(1, MAX_GROUP_SIZE))
    """Samples wanted for this prompt, ``1 <= group_size <= MAX_GROUP_SIZE``: the group of GRPO-style
    advantage estimators."""
    attempt: int = wire(COUNT, default=0)
    """How many times this (prompt, epoch) was re-queued after a stale drop (0 for the first load)."""
    prompt_token_ids: np.ndarray | None = wire(Optional(_PROMPT_TOKENS), default=None)
    """Optional pre-tokenised prompt, int32 ``[P]``, ``P >= 1``, ids >= 0; ``None``: the producer tokenises."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time (seconds) the record was created."""
    messages: list[dict[str, str]] | None = wire(Optional(MapList(StrMap(Str()))), default=None, added=True)
    """The conversation as loaded (OpenAI format: ``role`` in system/user/assistant/tool, ``content``), for a
    conversational prompt; ``None`` for a plain ``text`` prompt. Multi-turn environments continue it on the chat
    template; ``text`` and ``prompt_token_ids`` are its rendering."""

    @property
    def group_id(self) -> str:
        """The group id every sample of this prompt and epoch will carry."""
        return group_id_for(self.prompt_id, self.epoch)


@message
class Rollout(Message):
    """One sampled response with what the trainer needs to correct for off-policy sampling.

    Rollouts topic, key ``group_id`` (a group stays on one partition). ``R = len(response_token_ids) >= 1``.
    """

    KIND: ClassVar[str] = "rollout"

    rollout_id: str = wire(ID)
    """Deterministic id, must equal ``rollout_id_for(prompt_id, epoch, sample_index)``; the dedup key."""
    prompt_id: str = wire(PROMPT_ID)
    """Id of the prompt this samples (``ID_PATTERN``, at most 200 characters)."""
    epoch: int = wire(COUNT)
    """Epoch of the prompt (>= 0)."""
    group_id: str = wire(ID)
    """Must equal ``group_id_for(prompt_id, epoch)``; independent of the attempt."""
    sample_index: int = wire(COUNT)
    """Position of this sample in its group, ``0 <= sample_index < group_size``."""
    group_size: int = wire(Int(1))
    """Number of samples in the group (>= 1)."""
    prompt_token_ids: np.ndarray = wire(_PROMPT_TOKENS)
    """Prompt tokens as the policy saw them, int32 ``[P]``, ``P >= 1``, ids >= 0."""
    response_token_ids: np.ndarray = wire(Array("<i4", min_len=1, minimum=0))
    """Sampled tokens, int32 ``[R]``, ``R >= 1``, ids >= 0 (including the stop token when one was sampled)."""
    behavior_logprobs: np.ndarray = wire(_LOGPROBS)
    """log mu(token) under the distribution actually sampled, float32 ``[R]``, finite, <= 0 (exactly 0.0 allowed:
    float32 rounding of log 1): ``log softmax(logits / temperature)`` truncated by the producer's min-p, top-k and
    top-p and renormalised over the kept tokens (the full tempered softmax when none is set; docs/algorithms.md,
    "Sampling controls")."""
    token_policy_versions: np.ndarray = wire(Array("<i8", minimum=0))
    """Policy (weights) version that produced each token, int64 ``[R]``, >= 0."""
    finish_reason: str = wire(Enum(FINISH_REASONS))
    """Why generation ended: ``"stop"`` (stop token or string), ``"length"`` (token budget), ``"abort"``."""
    producer_id: str = wire(ID)
    """Id of the producer process that generated the sample (``ID_PATTERN``)."""
    prompt_text: str = wire(Str())
    """The prompt text (redacted by ``stream-rl replay`` unless ``--show-text``)."""
    response_text: str = wire(Str())
    """The detokenised response (redacted by ``stream-rl replay`` unless ``--show-text``)."""
    answer: str | None = wire(Optional(Str()), default=None)
    """Reference answer copied from the prompt, ``None`` when there is none."""
    metadata: dict[str, str] = wire(_METADATA, default_factory=dict)
    """String tags copied from the prompt."""
    attempt: int = wire(COUNT, default=0)
    """Attempt of the prompt this was generated for (>= 0); not part of any id."""
    temperature: float = wire(Float(greater_than=0.0))
    """Sampling temperature, finite and > 0; the trainer divides logits by it before log-softmax."""
    timings: dict[str, float] = wire(_TIMINGS, default_factory=dict)
    """Finite floats, seconds or Unix times, e.g. ``generate_s``, ``created_at``, ``queue_wait_s``."""
    policy_mask: np.ndarray | None = wire(Optional(Array("|u1", minimum=0, maximum=1)), default=None, added=True)
    """Multi-turn: uint8 ``[R]``, 1 where the policy sampled the token (it gets loss, its behaviour logprob and
    version are real), 0 for environment or tool output inserted between turns (``behavior_logprobs`` 0 there).
    ``None``: every token is the policy's (a single-turn rollout)."""
    turns: list[dict[str, str]] | None = wire(Optional(MapList(StrMap(Str()))), default=None, added=True)
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


@message
class ScoredRollout(Message):
    """A rollout with its rewards and reference log-probabilities. Scored topic, key ``rollout.group_id``."""

    KIND: ClassVar[str] = "scored_rollout"

    rollout: Rollout = wire(Embedded(Rollout))
    """The scored rollout, embedded whole and validated as a rollout record."""
    reward: float = wire(Float())
    """Sequence-level reward (finite): the sum of the components as the scorer defines it."""
    reward_components: dict[str, float] = wire(StrMap(Float()), default_factory=dict)
    """Named finite parts of the reward, e.g. ``{"correct": 1.0, "format": 0.1}``, for metrics."""
    token_rewards: np.ndarray | None = wire(Optional(Array("<f4", finite=True)), default=None)
    """Optional token-level rewards, float32 ``[R]``, finite."""
    ref_logprobs: np.ndarray | None = wire(Optional(_LOGPROBS), default=None)
    """Optional log pi_ref(token) of the frozen reference model, float32 ``[R]``, finite, <= 0."""
    scorer_id: str = wire(ID)
    """Id of the scorer process (``ID_PATTERN``)."""
    timings: dict[str, float] = wire(_TIMINGS, default_factory=dict)
    """Finite floats, e.g. ``score_s``, ``ref_logprobs_s``, ``created_at``."""

    @property
    def rollout_id(self) -> str:
        """The embedded rollout's id."""
        return self.rollout.rollout_id

    @property
    def group_id(self) -> str:
        """The embedded rollout's group id (the record key)."""
        return self.rollout.group_id


@message
class MemberRejected(Message):
    """A member of a group that a consumer dead-lettered, so the group can never complete. Scored topic, key
    ``group_id``: it follows the group's other members on their partition, and the trainer drops the group at
    once (its buffered members to the stale topic, its prompt re-queued) instead of holding its partition's safe
    offset until the group goes stale. Its dead letter, with the record itself, is on the dlq topic."""

    KIND: ClassVar[str] = "member_rejected"

    group_id: str = wire(ID)
    """The group (``group_id_for(prompt_id, epoch)``): the rejected record's ``group_id``, or its key when its
    value could not be decoded."""
    rollout_id: str | None = wire(Optional(ID), default=None)
    """The rejected rollout's id; ``None`` when its value could not be decoded."""
    attempt: int | None = wire(Optional(COUNT), default=None)
    """The rejected rollout's attempt (>= 0); ``None`` when its value could not be decoded."""
    reason: str = wire(Str(nonempty=True))
    """Why it was rejected (non-empty), as in its dead letter."""
    error_type: str = wire(Str(nonempty=True))
    """Class name of the error, as in its dead letter (non-empty)."""
    source_topic: str = wire(TOPIC)
    """Topic the rejected record was read from."""
    source_partition: int = wire(COUNT)
    """Its partition (>= 0)."""
    source_offset: int = wire(COUNT)
    """Its offset (>= 0)."""
    consumer_id: str = wire(ID)
    """Id of the consumer that rejected it (``ID_PATTERN``)."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time of the rejection."""
