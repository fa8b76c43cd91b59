"""The trainer's intake: polled records into the batcher, and the groups it drops out to the broker.

Consumes: each polled ``ScoredRollout`` or ``MemberRejected`` record, the records the transport edge dead-lettered
in the last poll (``source.take_rejections()``), the :class:`~consumers.trainer.admit.ModelLimits` of the policy, and the
:class:`~consumers.trainer.batcher.StaleDrop` lists the batcher returns (here, or from the trainer's step).
Produces: records added to the batcher; a dead letter (``AdmissionError``, with the reason) for a rollout the model
cannot take; ``StaleRollout`` records on ``names.stale`` (key ``group_id``) and re-queued ``Prompt`` records on
``names.prompts`` (key ``prompt_id``), each re-queue logged in ``run_dir/requeued.jsonl``
(:mod:`~consumers.trainer.history`).
Guarantees:
- A record the model cannot take never reaches the batcher's groups: it is dead-lettered and its group dropped at
  once (stale + re-queue), so it never pins its partition's safe offset. So is a group a scorer's
  ``MemberRejected`` names, or one named by a record the edge dead-lettered (decoded, or keyed by a group id); an
  edge rejection that names no group still counts as seen, so safe offsets move past it.
- A scored rollout generated with a policy version above the trainer's own raises
  :class:`~consumers.trainer.versions.ForeignRunError` naming it: no trainer of this run published that version
  (a resume continues the numbering above every published one), so it is another run's data, never "stale".
- Drops are sent in a span continuing the trace of what caused them (the record, or the step); re-queued prompts
  are flushed (acknowledged by the broker) before they are logged, so a logged re-queue is on the broker and a
  resumed trainer never sends it again.
"""

from __future__ import annotations

import logging
from pathlib import Path

from consumers.trainer.admit import ModelLimits, check_scored
from consumers.trainer.batcher import Batcher, StaleDrop
from consumers.trainer.history import log_requeues
from consumers.trainer.versions import foreign_run
from schemas import MemberRejected
from stream_rl.transport.rejections import group_of
from stream_rl.transport.topics import TopicNames

log = logging.getLogger(__name__)


class Intake:
    """Admission into ``batcher`` and the sends of its drops, through the trainer's ``source`` and ``sink``."""

    def __init__(self, batcher: Batcher, limits: ModelLimits, source, sink, names: TopicNames, requeue_path: Path):
        self.batcher, self.limits = batcher, limits
        self.source, self.sink, self.names, self.requeue_path = source, sink, names, requeue_path

    def admit(self, record, version: int) -> None:
        """Check ``record`` against the model (:mod:`consumers.trainer.admit`): into the batcher, or dead-lettered
        with the reason and its group dropped at once (it could never complete); drops continue its trace."""
        self.send(self._admitted(record, version), record.headers)

    def _admitted(self, record, version: int) -> list[StaleDrop]:
        if isinstance(record.value, MemberRejected):  # a scorer dead-lettered a member of this group
            notice = record.value
            return self.batcher.reject_member(
                notice.group_id, notice.attempt, f"{notice.rollout_id or 'a rollout'} by {notice.consumer_id} "
                f"({notice.error_type}): {notice.reason}", version, at=record)
        if record.value.rollout.max_policy_version > version:  # never "stale": data of another run's trainer
            raise foreign_run(self.names.run, f"scored rollout {record.value.rollout_id} at {record.topic}"
                              f"[{record.partition}]@{record.offset} (policy version "
                              f"{record.value.rollout.max_policy_version})", version)
        rejection = check_scored(record.value, self.limits)
        if rejection is None:
            return self.batcher.add(record, version)
        self.source.dead_letter_record(record, rejection.reason, rejection.error_type)
        return self.batcher.reject(record, version, rejection.reason)

    def edge_rejections(self, version: int) -> None:
        """The records the transport edge dead-lettered in the last poll: each counts as seen (safe offsets move
        past it), and a group one names (decoded, or keyed by a group id) is dropped (it can never complete)."""
        rejections = self.source.take_rejections()
        drops = []
        for rejection in rejections:
            named = group_of(rejection.value, rejection.key)
            if named is None:
                self.batcher.see(rejection)
                continue
            drops += self.batcher.reject_member(named.group_id, named.attempt, rejection.reason, version,
                                                at=rejection)
        self.send(drops)

    def send(self, drops: list[StaleDrop], trace=None) -> None:
        """Stale records and re-queued prompts, in a span continuing ``trace`` (the headers of the record or the
        step that caused them); the re-queues are flushed, then logged (never sent twice)."""
        if not drops:
            return
        if trace is not None:
            with self.source.process_span_of("drop", trace):
                self.send(drops)
            return
        requeued = []
        for drop in drops:
            for stale in drop.stale:
                self.sink.send(self.names.stale, stale, key=stale.group_id)
            if drop.requeue is not None:
                self.sink.send(self.names.prompts, drop.requeue, key=drop.requeue.prompt_id)
                requeued.append(drop.requeue)
                log.info("re-queued %s epoch %d as attempt %d (%s)", drop.requeue.prompt_id, drop.requeue.epoch,
                         drop.requeue.attempt, drop.reason)
        if requeued:
            self.sink.flush()
            log_requeues(self.requeue_path, self.names.prompts, requeued)
