"""Naming the group of a rejected record: a dead-lettered member means its group can never complete.

Consumes: the records a source dead-lettered at the transport edge (:class:`EdgeRejection`: a value that did not
decode or validate, a wrong key, an unreadable batch) and rollouts a role rejected after decoding.
Produces: :func:`group_of` (the group, rollout id and attempt a rejected record names, or None) and
:func:`member_rejected` (the ``MemberRejected`` notice a scorer publishes on the scored topic, key ``group_id``).
Guarantees: a group is named only from a decoded rollout's ``group_id`` or from a record key that is a
well-formed group id (``<prompt_id>:<epoch>``); nothing is guessed. A rejection that names no group gives None:
its dead letter is the whole record of it.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from schemas import MemberRejected, Rollout, ScoredRollout, is_group_id


class EdgeRejection(NamedTuple):
    """One record a source dead-lettered itself, before any role saw it (``Source.take_rejections``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: Any  # the decoded message when only its key was wrong, else None
    reason: str
    error_type: str


class Named(NamedTuple):
    group_id: str
    rollout_id: str | None
    attempt: int | None


def group_of(value: Any, key: bytes | None) -> Named | None:
    """The group a rejected record belongs to: from its decoded rollout, else from a key that is a group id."""
    rollout = value.rollout if isinstance(value, ScoredRollout) else value
    if isinstance(rollout, Rollout):
        return Named(rollout.group_id, rollout.rollout_id, rollout.attempt)
    if value is not None or key is None:
        return None
    try:
        group_id = key.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not is_group_id(group_id):
        return None
    return Named(group_id, None, None)


def member_rejected(value: Any, key: bytes | None, *, topic: str, partition: int, offset: int, reason: str,
                    error_type: str, consumer_id: str) -> MemberRejected | None:
    """The notice for one rejected record, or None when it names no group (:func:`group_of`)."""
    named = group_of(value, key)
    if named is None:
        return None
    return MemberRejected(group_id=named.group_id, rollout_id=named.rollout_id, attempt=named.attempt,
                          reason=reason[:4000], error_type=error_type, source_topic=topic, source_partition=partition,
                          source_offset=offset, consumer_id=consumer_id, created_at=time.time())


def notice_of(rejection: EdgeRejection, consumer_id: str) -> MemberRejected | None:
    """:func:`member_rejected` of an edge rejection."""
    return member_rejected(rejection.value, rejection.key, topic=rejection.topic, partition=rejection.partition,
                           offset=rejection.offset, reason=rejection.reason, error_type=rejection.error_type,
                           consumer_id=consumer_id)
