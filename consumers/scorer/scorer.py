"""``stream-rl score``: the scorer role's loop, a thin shell around :func:`consumers.scorer.scoring.score_rollouts`.

Consumes: ``Rollout`` records from ``names.rollouts`` in the consumer group ``{prefix}.{run}.scorers``.
Produces: ``ScoredRollout`` records on ``names.scored`` keyed by ``group_id`` (a GRPO group stays on one
partition); ``DeadLetter`` records on ``names.dlq`` for rollouts that cannot be scored (reason and source offset)
and, through the transport, for records that do not decode as rollouts; for each dead-lettered rollout that names
its group (decoded, or keyed by a well-formed group id), a ``MemberRejected`` on ``names.scored`` keyed by that
``group_id``, so the trainer drops the group at once (it can never complete).

One iteration::

    poll(<= batch_size) ─> score_rollouts (pure, batched) ─> per record: send ScoredRollout | dead-letter
                                                              ─> sink.flush() (broker acked) ─> source.commit()

With ``scorer.batches_in_flight`` K > 1 (:class:`InFlight`), each polled batch is scored on a worker thread and the
loop polls the next one while up to K are in flight (their reward calls overlap); the oldest finished batch is
sent, flushed and committed first, in poll order, up to its own records' offsets, so a later batch finishing
first waits for the ones before it.

Guarantees:
- An offset is committed only after every output derived from the records before it (scored rollouts and dead
  letters) was acknowledged by the broker; a crash before the commit redelivers the batch (at-least-once), a
  restart after it re-reads nothing.
- Several scorers in one group split the partitions; in steady state (no rebalance) every rollout is scored by
  exactly one of them. A commit lost to a rebalance means the new owner scores those records again: downstream,
  the trainer drops duplicates by ``rollout_id`` (scores are deterministic given the models, so either copy is
  equally good).
- A dead-lettered rollout carries its reason, source topic/partition/offset, key and original record bytes, and
  continues the rollout's trace. A rollout whose token ids are outside the reference or reward model's
  vocabulary, or longer than its context, is dead-lettered with that reason before any forward pass. A scored
  record that would exceed ``kafka.max_request_size`` is never sent: its rollout is dead-lettered
  (``RecordTooLarge``, both sizes in the reason) and its group rejected, and the scorer goes on. A record
  batch the client cannot read is dead-lettered by the transport, which seeks past it (no crash loop).
- ``max_batches`` counts every poll that returned records, also one whose records were all dead-lettered by the
  transport (undecodable, invalid): ``stream-rl score --max-batches N`` ends on a topic of dead letters too.
- Reward calls run with a deadline, bounded concurrency and bounded retries (:mod:`consumers.scorer.services`):
  a batch takes at most about ``(reward_max_retries + 1) * reward_timeout_s`` plus backoffs, liveness ticks
  while it waits, and a rollout whose reward timed out or failed is dead-lettered with the reason (or counted
  as ``zeroed`` with ``scorer.on_reward_error = "zero"``); the commit still follows every output of the batch.
  Per-reward, per-data-source call metrics (latency p50/p99, timeouts, retries, errors) join the batch's log.
- With ``batches_in_flight`` > 1 the guarantees above hold per batch: a batch's offsets (one past each of its
  records, per partition) are committed only after its own outputs and every earlier batch's were acknowledged;
  a crash redelivers every batch in flight. Reward-call metrics are then those drained when each batch is sent.
- Heartbeats report the batches done in ``step``. A broker that stays unreachable for
  ``kafka.broker_timeout_s`` stops the scorer with ``BrokerUnreachable`` naming it (exit non-zero).
- Tracing: the batch's compute runs in a ``process score-batch`` span linked to every rollout's trace; each
  output is sent inside a ``process score`` span that is the child of its own rollout's producer span, so a
  scored rollout continues the trace of the rollout it came from.
- Errors other than per-rollout scoring failures (broker not acknowledging, a model that cannot run) propagate
  and stop the scorer without committing; the consumer and producer are closed on the way out.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from consumers.scorer.config import ScorerConfig
from consumers.scorer.scoring import Rejected, Scoring, batch_metrics, load_scoring, score_rollouts
from schemas import MemberRejected
from stream_rl.config.shared import SharedConfig
from stream_rl.telemetry.role import RoleTelemetry
from stream_rl.transport import Consumed, RecordTooLarge, Sink, Source
from stream_rl.transport.client import Transport
from stream_rl.transport.rejections import member_rejected, notice_of
from stream_rl.transport.topics import TopicNames
from stream_rl.transport.tracing import Tracing

log = logging.getLogger(__name__)


@dataclass
class ScorerStats:
    """What one scorer process did (returned by :func:`run_scorer`)."""

    batches: int = 0
    """Non-empty batches: polls that returned records, or whose records were all dead-lettered by the transport."""
    scored: int = 0
    """ScoredRollouts sent (each acknowledged by the broker before the commit that follows it)."""
    rejected: int = 0
    """Rollouts dead-lettered by the step (reward or model failure)."""
    commits: int = 0
    """Successful offset commits."""
    lost_commits: int = 0
    """Commits lost to a rebalance (those records go to the partition's new owner)."""


def scorer_group(cfg: SharedConfig) -> str:
    """The scorers' consumer group of this run: ``{prefix}.{run}.scorers``."""
    return TopicNames.from_config(cfg.topics).group("scorers")


@dataclass(frozen=True)
class ScorerDeps:
    """What a caller hands :func:`run_scorer` instead of building it (tests do); None: the production one."""

    scoring: Scoring | None = None
    """Already loaded models; None: ``load_scoring(scfg, scorer_id)``."""
    tracing: Tracing | None = None
    """Tracing owned (and shut down) by the caller; None: one built from ``cfg.tracing``, shut down on return."""


def run_scorer(shared: SharedConfig, scfg: ScorerConfig, stop_event: threading.Event | None = None,
               max_batches: int | None = None, *, deps: ScorerDeps | None = None) -> ScorerStats:
    """Score rollouts until ``stop_event`` is set or ``max_batches`` non-empty batches were handled (scored or,
    for a batch of undecodable records, dead-lettered). ``shared``: the shared sections; ``scfg``: the scorer's
    own section (``scorer``)."""
    deps = deps if deps is not None else ScorerDeps()
    transport = Transport(shared, "scorer", tracing=deps.tracing)
    scoring = deps.scoring if deps.scoring is not None else load_scoring(scfg, scfg.scorer_id or
                                                                          transport.instance_id)
    _ensure_run_topics(transport)
    sink = transport.sink()
    telemetry = RoleTelemetry(shared, "scorer", transport, group=scorer_group(shared),
                              topics=[transport.names.rollouts])
    source = transport.source([transport.names.rollouts], scorer_group(shared), "rollout", sink,
                              keep_rejections=True,  # every edge dead letter: a MemberRejected on the scored topic
                              pause_when=lambda: telemetry.paused)  # alerts: "pause"
    telemetry.attach(source, sink).set_ready(model_loaded=True, version=0)  # scores do not depend on the policy
    stats = ScorerStats()
    log.info("scorer %s subscribed to %s in group %s", scoring.scorer_id, transport.names.rollouts, scorer_group(shared))
    if scfg.batches_in_flight > 1:
        return _run_in_flight(scfg, source, sink, transport, scoring, telemetry, stats, stop_event, max_batches,
                              deps)
    try:
        while not (stop_event is not None and stop_event.is_set()) and \
                (max_batches is None or stats.batches < max_batches):
            telemetry.tick()  # alerts: "stop" ends here, after the previous batch was committed
            telemetry.check_stop()
            dead_before = source.dead_lettered
            records = source.poll(scfg.poll_timeout_s, max_records=scfg.batch_size)
            send_notices(source, sink, transport.names.scored, transport.instance_id)
            if records:
                started = time.monotonic()
                calls = score_and_send(records, source, sink, transport.names.scored, scoring, stats,
                                       transport.instance_id, on_wait=telemetry.tick)  # liveness while calls run
                if calls:
                    telemetry.step_metrics = calls  # heartbeats carry the last batch's reward-call metrics
                telemetry.observe_seconds("score", time.monotonic() - started)
                telemetry.tokens(sum(r.value.response_length for r in records))
            if records or source.dead_lettered > dead_before:  # a batch of dead letters only is a batch too
                stats.batches += 1
                telemetry.set_step(stats.batches)  # heartbeats' ``step``: batches done
            if records or sink.pending:  # the transport may have dead-lettered undecodable records
                sink.flush()
                if source.commit():
                    stats.commits += 1
                else:
                    stats.lost_commits += 1
                    telemetry.error("CommitLost")
    except Exception as exc:
        telemetry.error(type(exc).__name__)
        raise
    finally:
        _close(telemetry, source, sink, scoring, transport, deps)
    return stats


def _close(telemetry, source: Source, sink: Sink, scoring: Scoring, transport: Transport, deps: ScorerDeps) -> None:
    telemetry.close()
    source.close()
    sink.close()
    if deps.scoring is None and scoring.services is not None:
        scoring.services.close()
    if deps.tracing is None:
        transport.tracing.shutdown()


class InFlight:
    """Up to ``size`` polled batches being scored on worker threads; finished ones are sent and committed by the
    loop's thread in poll order (module docstring)."""

    def __init__(self, size: int, source: Source, sink: Sink, scored_topic: str, scoring: Scoring,
                 stats: ScorerStats, consumer_id: str) -> None:
        self.size, self.source, self.sink, self.scored_topic = size, source, sink, scored_topic
        self.scoring, self.stats, self.consumer_id = scoring, stats, consumer_id
        self.pool = ThreadPoolExecutor(size, thread_name_prefix="score-batch")
        self.batches: deque[tuple[list[Consumed], Future, float]] = deque()

    def submit(self, records: list[Consumed]) -> None:
        def score() -> list:
            with self.source.process_span("score-batch", records, {"stream_rl.batch_size": len(records)}):
                return score_rollouts([record.value for record in records], self.scoring)

        self.batches.append((records, self.pool.submit(score), time.monotonic()))

    @property
    def full(self) -> bool:
        return len(self.batches) >= self.size

    def finish(self, wait: bool, on_wait: Callable[[], None] | None = None) -> list[tuple[dict[str, float], float]]:
        """Send and commit the finished batches at the head, in order (``wait``: block for the oldest one first,
        ticking ``on_wait`` about once a second); for each batch sent, its reward-call metrics and its seconds
        from submission to sent (the ``score`` stage: scoring, any wait for an earlier batch, and the sends)."""
        done = []
        while self.batches and (wait or self.batches[0][1].done()):
            records, future, submitted = self.batches[0]
            while not future.done():
                _wait_for(future, on_wait)
            self.batches.popleft()
            calls = send_outputs(records, future.result(), self.source, self.sink, self.scored_topic,
                                 self.scoring, self.stats, self.consumer_id)
            done.append((calls, time.monotonic() - submitted))
            self.sink.flush()
            committed = self.source.commit(next_offsets(records))
            self.stats.commits += int(committed)
            self.stats.lost_commits += int(not committed)
            wait = False  # only the oldest is waited for; the rest go when they are done
        return done

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _wait_for(future: Future, on_wait: Callable[[], None] | None) -> None:
    try:
        future.exception(timeout=1.0)
    except TimeoutError:
        if on_wait is not None:
            on_wait()


def next_offsets(records: Sequence[Consumed]) -> dict[tuple[str, int], int]:
    """One past the last of ``records`` in each partition: what a batch's commit covers."""
    out: dict[tuple[str, int], int] = {}
    for r in records:
        out[(r.topic, r.partition)] = max(out.get((r.topic, r.partition), 0), r.offset + 1)
    return out


def _run_in_flight(scfg: ScorerConfig, source: Source, sink: Sink, transport: Transport, scoring: Scoring,
                   telemetry, stats: ScorerStats, stop_event: threading.Event | None, max_batches: int | None,
                   deps: ScorerDeps) -> ScorerStats:
    """The loop with ``scorer.batches_in_flight`` > 1: poll while earlier batches are scored (:class:`InFlight`)."""
    flight = InFlight(scfg.batches_in_flight, source, sink, transport.names.scored, scoring, stats,
                      transport.instance_id)
    try:
        while not (stop_event is not None and stop_event.is_set()) and \
                (max_batches is None or stats.batches < max_batches):
            telemetry.tick()
            telemetry.check_stop()
            _record(telemetry, flight.finish(wait=flight.full, on_wait=telemetry.tick))
            dead_before = source.dead_lettered
            records = source.poll(scfg.poll_timeout_s if not flight.batches else 0.05, max_records=scfg.batch_size)
            send_notices(source, sink, transport.names.scored, transport.instance_id)
            if records:
                flight.submit(records)
                telemetry.tokens(sum(r.value.response_length for r in records))
            if records or source.dead_lettered > dead_before:
                stats.batches += 1
                telemetry.set_step(stats.batches)
            if not records and not flight.batches and sink.pending:  # edge dead letters of an empty poll
                sink.flush()
                stats.commits += int(source.commit())
        while flight.batches:  # what was polled is scored, sent and committed
            _record(telemetry, flight.finish(wait=True, on_wait=telemetry.tick))
    except Exception as exc:
        telemetry.error(type(exc).__name__)
        raise
    finally:
        flight.close()
        _close(telemetry, source, sink, scoring, transport, deps)
    return stats


def _record(telemetry, sent: Sequence[tuple[dict[str, float], float]]) -> None:
    """Each sent batch's ``score`` stage seconds, and the last one's reward-call metrics for the heartbeats."""
    for calls, seconds in sent:
        telemetry.observe_seconds("score", seconds)
        if calls:
            telemetry.step_metrics = calls


def _ensure_run_topics(transport: Transport) -> None:
    """Create the run's topics if any is missing (a scorer may start before ``stream-rl run`` made them).

    Topics that exist are left alone and not re-described: partition counts are checked by whoever creates the
    run's topics (``stream-rl run`` / ``stream-rl topics create``)."""
    with transport.admin() as admin:
        existing = admin.list_topics()
    wanted = {transport.names.rollouts, transport.names.scored, transport.names.dlq}
    if not wanted <= existing:
        transport.ensure_topics()


def score_and_send(records: Sequence[Consumed], source: Source, sink: Sink, scored_topic: str,
                   scoring: Scoring, stats: ScorerStats, consumer_id: str,
                   on_wait: Callable[[], None] | None = None) -> dict[str, float]:
    """Score one polled batch and send each result: a ScoredRollout on ``scored_topic`` (key ``group_id``), or
    a dead letter plus its group's MemberRejected; counts go to ``stats`` (also used by ``stream-rl rescore``).
    Returns the batch's reward-call metrics (``rewards/<reward>/<data_source>/...``)."""
    with source.process_span("score-batch", records, {"stream_rl.batch_size": len(records)}):
        outputs = score_rollouts([record.value for record in records], scoring, on_wait=on_wait)
    return send_outputs(records, outputs, source, sink, scored_topic, scoring, stats, consumer_id)


def send_outputs(records: Sequence[Consumed], outputs: Sequence, source: Source, sink: Sink, scored_topic: str,
                 scoring: Scoring, stats: ScorerStats, consumer_id: str) -> dict[str, float]:
    """Send each scored output of ``records`` (or its dead letter and group notice); the reward-call metrics."""
    sent = list(outputs)  # what became of each rollout: the batch log counts a RecordTooLarge as rejected
    for i, (record, result) in enumerate(zip(records, outputs, strict=True)):
        with source.process_span("score", [record]):  # child of this rollout's trace
            if not isinstance(result, Rejected):
                try:
                    sink.send(scored_topic, result, key=result.group_id)
                    stats.scored += 1
                    continue
                except RecordTooLarge as exc:  # never sent: dead-lettered with both sizes, its group dropped
                    result = sent[i] = Rejected(record.value, str(exc), "RecordTooLarge")
            source.dead_letter_record(record, result.reason, result.error_type)
            _send_notice(sink, scored_topic, member_rejected(
                record.value, record.key, topic=record.topic, partition=record.partition, offset=record.offset,
                reason=result.reason, error_type=result.error_type, consumer_id=consumer_id))
            stats.rejected += 1
    calls = scoring.services.stats.drain() if scoring.services is not None else {}
    log.info("scorer batch %s", json.dumps({**batch_metrics(sent), **calls}, sort_keys=True))
    return calls


def send_notices(source: Source, sink: Sink, scored_topic: str, consumer_id: str) -> None:
    """A MemberRejected for every rollout the edge dead-lettered in the last poll that names its group."""
    for rejection in source.take_rejections():
        _send_notice(sink, scored_topic, notice_of(rejection, consumer_id))


def _send_notice(sink: Sink, scored_topic: str, notice: MemberRejected | None) -> None:
    """Publish ``notice`` next to its group's scored members (key ``group_id``), so that the trainer drops the
    group at once instead of waiting for it to go stale."""
    if notice is not None:
        sink.send(scored_topic, notice, key=notice.group_id)
