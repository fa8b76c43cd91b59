"""The gateway's record of black-box agent episodes: one record per model call, one per change of an episode's state.

Consumes: nothing (plain data). Produces: :class:`GatewayCall` and :class:`GatewayEpisode`, declared once with
:func:`~schemas.declare.message`; both travel on the run's ``gateway`` topic keyed by ``episode_id``, so one
episode's records stay in order on one partition. The cross-field rules are in :mod:`schemas.validation`.

Guarantees: as for every message (:mod:`schemas.messages`). A call's per-token arrays have one entry per sampled
token; ``messages_json`` and ``tools_json`` hold the request's ``messages`` and ``tools`` exactly as the agent sent
them (JSON text: tool calls and content parts are nested objects, which the wire's string maps cannot hold).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from schemas.declare import COUNT, ID, TIME, Message, message, now, wire
from schemas.fields import Array, Bool, Enum, Float, Optional, Str, StrMap

CALL_ENDPOINTS = ("chat", "completion")
"""``/v1/chat/completions`` (``chat``) or ``/v1/completions`` (``completion``)."""
EPISODE_OUTCOMES = ("ended", "dead_lettered", "published")
"""An episode's states after its calls: ended with a reward (or for the scorer to score), dead-lettered with its
reason (never trained), published (its rollouts were acknowledged on the rollouts topic)."""


@message
class GatewayCall(Message):
    """One model call of an agent's episode, recorded (and acknowledged by the broker) before it is answered.
    Gateway topic, key ``episode_id``. ``R = len(response_token_ids) >= 1``."""

    KIND: ClassVar[str] = "gateway_call"

    episode_id: str = wire(ID)
    """The agent's episode (``ID_PATTERN``); ``GROUP/NAME`` puts it in group ``GROUP`` (docs/agents.md)."""
    call_index: int = wire(COUNT)
    """Position of this call in its episode (0, 1, ...)."""
    endpoint: str = wire(Enum(CALL_ENDPOINTS))
    """``chat`` (``/v1/chat/completions``) or ``completion`` (``/v1/completions``)."""
    messages_json: str = wire(Str())
    """The request's ``messages`` as the agent sent them (JSON), or its ``prompt`` string (JSON) for a completion."""
    tools_json: str | None = wire(Optional(Str()), default=None)
    """The request's ``tools`` (JSON), ``None`` when it had none."""
    prompt_token_ids: np.ndarray = wire(Array("<i4", min_len=1, minimum=0))
    """The rendered prompt's token ids, int32 ``[P]``: what the policy was conditioned on."""
    response_token_ids: np.ndarray = wire(Array("<i4", min_len=1, minimum=0))
    """The sampled token ids, int32 ``[R]``."""
    behavior_logprobs: np.ndarray = wire(Array("<f4", finite=True, maximum=0.0))
    """log mu(token) of each sampled token under the distribution it was drawn from, float32 ``[R]``."""
    token_policy_versions: np.ndarray = wire(Array("<i8", minimum=0))
    """Policy version that produced each token, int64 ``[R]``."""
    finish_reason: str = wire(Enum(("stop", "length")))
    """Why the sample ended (the engine's reason; a parsed tool call is still ``stop`` here)."""
    temperature: float = wire(Float(greater_than=0.0))
    """Sampling temperature of the call."""
    response_text: str = wire(Str())
    """The sampled text as answered (special tokens skipped)."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time the call was recorded."""


@message
class GatewayEpisode(Message):
    """A change of an episode's state after its calls. Gateway topic, key ``episode_id``."""

    KIND: ClassVar[str] = "gateway_episode"

    episode_id: str = wire(ID)
    """The episode (``ID_PATTERN``)."""
    outcome: str = wire(Enum(EPISODE_OUTCOMES))
    """``ended``, ``dead_lettered`` or ``published`` (:data:`EPISODE_OUTCOMES`)."""
    reward: float | None = wire(Optional(Float()), default=None)
    """``ended``: the reward the agent's environment gave; ``None``: the scorer's reward functions score it."""
    answer: str | None = wire(Optional(Str()), default=None)
    """``ended``: a reference answer for the scorer's reward functions, ``None`` when none was given."""
    metadata: dict[str, str] = wire(StrMap(Str()), default_factory=dict)
    """``ended``: string tags given at the end, copied onto the episode's rollouts."""
    reason: str = wire(Str())
    """``dead_lettered``: why (non-empty); else empty."""
    calls: int = wire(COUNT)
    """How many calls the episode had when its state changed."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time of the change."""
    refill: bool = wire(Bool(), default=False, added=True)
    """``dead_lettered`` only: another episode of its group takes its place (the agent said so ending it as failed),
    so it does not count toward the group's size; a second ``dead_lettered`` record of the same episode with
    ``refill`` false (its replacement never started in time) makes it count."""
