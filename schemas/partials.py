"""The durable prefix of a cut group: what a producer had generated for a prompt when its batch stopped decoding.

Consumes: nothing (plain data). Produces: :class:`PartialGroup`, declared once with :func:`~schemas.declare.message`;
it travels on the run's ``partials`` topic keyed by ``group_id`` (:mod:`producers.partials` writes, resumes and
drops them). The cross-field rule is in :mod:`schemas.validation`.

Guarantees: as for every message (:mod:`schemas.messages`). The samples' tokens are stored flat, sample after
sample (``sample_lengths[i]`` tokens each), with one behaviour logprob and one policy version per token, exactly as
the rollouts the group becomes will carry them; ``finish_reasons[i]`` is ``"cut"`` for a sample still running at
the cut (to be continued), else how it ended (kept whole).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from schemas.declare import ID, TIME, Embedded, Message, message, now, wire
from schemas.fields import Array, Int, StrList
from schemas.samples import Prompt

PARTIAL_FINISH_REASONS = ("stop", "length", "cut")
"""A prefix sample's state: ended (``stop``, ``length``: kept whole) or ``cut`` (still running: continued)."""


@message
class PartialGroup(Message):
    """The prefixes of one group cut before its last sample ended. Partials topic, key ``group_id``.
    ``T = sum(sample_lengths)``."""

    KIND: ClassVar[str] = "partial_group"

    group_id: str = wire(ID)
    """Must equal ``prompt.group_id``: the group the resumed rollouts complete."""
    prompt: Prompt = wire(Embedded(Prompt))
    """The prompt record the group was generated for, whole (a stale prefix regenerates it from scratch)."""
    prompt_token_ids: np.ndarray = wire(Array("<i4", min_len=1, minimum=0))
    """The prompt's token ids as the policy read them, int32 ``[P]``."""
    sample_lengths: np.ndarray = wire(Array("<i4", min_len=1, minimum=1))
    """Tokens generated so far per sample, int32 ``[N]`` (``N`` = the group size), each >= 1."""
    token_ids: np.ndarray = wire(Array("<i4", min_len=1, minimum=0))
    """The samples' tokens, flat, int32 ``[T]``."""
    behavior_logprobs: np.ndarray = wire(Array("<f4", finite=True, maximum=0.0))
    """Their behaviour logprobs, float32 ``[T]`` (as in :class:`~schemas.Rollout`)."""
    token_policy_versions: np.ndarray = wire(Array("<i8", minimum=0))
    """The policy version that produced each token, int64 ``[T]``."""
    finish_reasons: list[str] = wire(StrList())
    """Per sample, one of :data:`PARTIAL_FINISH_REASONS` (``[N]``); at least one is ``cut``."""
    cuts: int = wire(Int(1))
    """How many times this group was cut so far (>= 1)."""
    producer_id: str = wire(ID)
    """Id of the producer that cut it."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time of the cut."""

    @property
    def min_policy_version(self) -> int:
        """Oldest policy version among the prefix tokens: the one the staleness bound is measured from."""
        return int(self.token_policy_versions.min())

