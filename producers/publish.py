"""Publishing one batch of the producer role (:mod:`producers.role`): rollouts, dead letters and the
prefixes of cut groups.

Consumes: a generation step's :class:`~producers.step.StepResult`, the prompt (or partial group) records it
came from, the role's transport source (for dead letters) and sink.
Produces: the rollouts on the rollouts topic keyed by ``group_id``; rejected prompts on the dead-letter topic with
the reason; with ``producer.partial_max_lag`` the cut groups' ``PartialGroup`` records on the partials topic.
Guarantees: a group is sent whole or not at all (a rollout that cannot fit ``kafka.max_request_size`` dead-letters
its prompt, ``RecordTooLarge``); :func:`publish` returns after the broker acknowledged everything sent, so the
caller may commit the prompts' offsets; nothing is dropped without a dead letter.
"""

from __future__ import annotations

import logging

from producers.step import GroupSink, StepResult
from schemas import group_id_for

log = logging.getLogger(__name__)


def dead_letter(source, rec, reason: str, error_type: str = "PromptRejected") -> None:
    """Dead-letter the prompt record ``rec`` with ``reason`` (``error_type``: ``PromptRejected``, or
    ``EnvironmentFailed`` for a failed play of a group that was played again)."""
    source.dead_letter(rec.topic, rec.partition, rec.offset, rec.key, rec.raw_value, reason, error_type)


def dead_letter_replays(source, records, replayed: list[tuple[str, int, str]]) -> None:
    """Dead-letter each failed environment play whose group was played again (``(prompt_id, epoch, reason)``,
    :attr:`producers.environment.EnvironmentFactory.replayed`) against its prompt's record: the episodes of that
    play are dropped, so they are recorded, even when the replay then trains."""
    by_prompt = {(r.value.prompt_id, r.value.epoch): r for r in records}
    for prompt_id, epoch, reason in replayed:
        record = by_prompt.get((prompt_id, epoch))
        if record is not None:
            dead_letter(source, record, reason, "EnvironmentFailed")


def publish_partials(result: StepResult, sink, topic: str | None) -> set[str]:
    """Send the cut groups' prefixes (``producer.partial_max_lag``) keyed by group; the group ids sent. The batch's
    flush (:func:`publish`) acknowledges them before the prompts are committed. A prefix too large for one record
    is not sent: its prompt is re-queued and regenerated from scratch instead."""
    if topic is None:
        return set()
    kept = set()
    for partial in result.partials:
        if sink.oversize(topic, partial, partial.group_id) is None:
            sink.send(topic, partial, key=partial.group_id)
            kept.add(partial.group_id)
    if kept:
        log.info("published the prefixes of %d cut group(s) to be resumed", len(kept))
    return kept


def group_sender(sink, topic: str, sent: set[str]) -> GroupSink:
    """``producer.stream_groups``: send each complete group as soon as the generation hands it over (the client
    transmits it after ``kafka.linger_ms``; the batch's flush still precedes the commit). A group with a rollout
    too large to send is left to :func:`publish`, which dead-letters its prompt."""

    def send(rollouts) -> None:
        group_id = rollouts[0].group_id
        if any(sink.oversize(topic, r, group_id) is not None for r in rollouts):
            return
        for rollout in rollouts:
            sink.send(topic, rollout, key=group_id)
        sent.add(group_id)

    return send


def publish(result: StepResult, records, source, sink, topic: str, sent: frozenset[str] | set[str] = frozenset(),
            group_of=lambda record: group_id_for(record.value.prompt_id, record.value.epoch)) -> None:
    """Send the rollouts keyed by group (except the groups in ``sent``, sent already) and dead-letter rejected
    prompts; wait for the broker's acks. A group with a rollout that cannot fit ``kafka.max_request_size`` is not
    sent at all: its prompt is dead-lettered (``RecordTooLarge``, both sizes), so no incomplete group ever reaches
    the scorers."""
    too_large: dict = {}  # group_id -> the RecordTooLarge of its first member that cannot fit, else None
    for rollout in result.rollouts:
        if too_large.get(rollout.group_id) is None:
            too_large[rollout.group_id] = sink.oversize(topic, rollout, rollout.group_id)
    for record in records:
        problem = too_large.get(group_of(record))
        if problem is not None:
            source.dead_letter(record.topic, record.partition, record.offset, record.key, record.raw_value,
                               f"{problem} (a rollout of its group)", "RecordTooLarge", headers=record.headers)
    for rollout in result.rollouts:
        if too_large[rollout.group_id] is None and rollout.group_id not in sent:
            sink.send(topic, rollout, key=rollout.group_id)
    for rejected in result.rejected:  # none after check_prompts; kept so no prompt is ever silently dropped
        dead_letter(source, records[rejected.index], rejected.reason)
    for dropped in result.dropped:  # work dropped, its input regenerated: on record all the same
        dead_letter(source, records[dropped.index], dropped.reason, "StalePartial")
    sink.flush()
