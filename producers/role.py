"""``stream-rl produce``: the producer role, a thin Kafka loop around the generation step (:mod:`producers.step`).

Consumes: ``Prompt`` records from the run's prompts topic, in the consumer group ``{prefix}.{run}.producers``
(so producer processes share the prompts; with ``producer.partial_max_lag`` the same consumer also reads the
partials topic, so a dead producer's partial groups move with its prompts in the group's rebalance), and weights
manifests/payloads through
:class:`~stream_rl.weights.receiver.WeightsReceiver` (followed by :mod:`producers.weights_follower`).
Produces: ``Rollout`` records on the rollouts topic keyed by ``group_id`` (a group stays on one partition);
prompts that cannot be generated for go to the dead-letter topic with the reason; with ``producer.partial_max_lag``
the prefixes of cut groups (``PartialGroup``) on the partials topic, keyed by ``group_id``.

One iteration::

    [between batches] newer manifest? ─ yes ─> fetch + verify ─> engine.load_weights ─> version v'
                        └─ WeightsError / WeightsMismatch: log, try the next newest version above v, else keep v
    [inside a generation, producer.inflight_updates] every inflight_check_every decode steps: the same look,
                        non-blocking (one pass over the weights topic), then the same fetch + verify + load
                        (a LoRA version, manifest.adapter_rank set: engine.load_adapter instead)
    stale records of groups this producer generated? ─> returned to the backpressure budget
    over budget (and not finishing an epoch, see below)? ─ yes ─> wait for newer weights (up to poll_timeout_s)
    poll <= prompts_per_batch prompts (or take the carried ones) ─> partial groups among them? ─ yes ─>
       resume them (producers.partials) ─> send ─> flush ─> commit; the prompts polled with them are carried
    ─> epoch gate
       ─> [first poll with an assignment] the budget inherits the groups in flight; over it now? carry, wait
       ─> check_prompts ─> plan_batch:
       a rejected run leads a partition ─> dead-letter those runs ─> flush ─> commit     (nothing generated)
       else the leading accepted runs   ─> produce_rollouts (pure) ─> send ─> flush (acks) ─> commit
       the records after those runs are carried to the next iteration, uncommitted

Backpressure (:mod:`producers.budget`): with ``producer.max_groups_per_version`` set (this producer's share of
the groups the trainer consumes per version), a producer with ``versions_ahead`` versions' shares in flight beyond
the weights it holds waits for a newer version before taking more prompts. Groups the trainer drops as stale
(read from the stale topic) no longer count, so its re-queued prompts are generated; after
``producer.backpressure_timeout_s`` without a newer version the budget is re-derived with nothing in flight. Generation
then overlaps training, and rollouts stay about ``versions_ahead`` versions old instead of piling up until they
are dropped as stale, and the pipeline never deadlocks on the budget. A (re)started producer begins its budget at
the newest version with the groups already in flight (:func:`producers.stale_feed.inheritance`), before it
generates anything: a restart keeps the steady lag (issue 45.1).

Epoch order (:mod:`producers.epoch_gate`, ``producer.epoch_order``): a first-load prompt of an epoch above the
open one holds its partition (sought back, paused, left uncommitted) until every partition is past the epochs
below it, so no prompt is generated a second time before every prompt was generated once. A producer over budget
whose peer's partition is idle at the open epoch (waiting at the boundary) generates what it may anyway.

Guarantees:
- Offsets are committed only after every rollout (and dead letter) of the batch was acknowledged by the broker,
  and only up to the first carried record: a crash before the commit regenerates the batch (same rollout ids;
  consumers drop duplicates by id, the budget does not count them), a restart after it reads no prompt twice.
  The failpoint ``producer.after_send`` (:mod:`stream_rl.runtime.failpoints`) kills the process between the two.
- A prompt the producer rejects (untokenisable, empty, too long, a group above ``producer.max_group_size``) is
  dead-lettered with the reason and committed before anything after it in its partition is generated, so a crash
  never makes a restart dead-letter it again or die on it. (A record the transport edge cannot decode is
  dead-lettered when it is polled and committed with its batch: a crash while that batch generates may
  dead-letter it a second time.)
- No batch barrier (``producer.stream_groups``): a group is sent as soon as its last sample ends (the hf engine
  hands it over from inside its decode loop), not when the batch's longest sample does; offsets are still
  committed only after the flush that follows the whole batch, so a crash regenerates the batch under the same
  rollout ids (duplicates are dropped by id downstream).
- Long tails (``producer.oversample``, ``producer.abort_after_s``, every engine): a batch may stop decoding
  before its slowest groups end. Without ``producer.partial_max_lag`` their prompts are carried into the next batch
  (uncommitted, ahead of later offsets of their partition, so a crash regenerates them too) and regenerated from
  scratch, protected from a second abort: nothing is dropped, and no partial sample is ever published.
- Durable partial rollouts (``producer.partial_max_lag``, :mod:`producers.partials`): the cut groups' prefixes
  (token ids, behaviour logprobs, per-token versions; a sample that had ended kept whole) are sent to the
  partials topic and flushed with the batch's rollouts before its prompts are committed, so a crash before the
  commit regenerates the batch (the partial and the regenerated group share rollout ids: duplicates downstream)
  and a crash after it leaves the prefixes on the broker; whichever producer of the group reads them (the same
  one at its next poll, or another after a rebalance) completes each cut sample from prompt + prefix on the
  weights it holds, sends the group as ordinary rollouts (prefix tokens keep their versions), flushes, then
  commits the partials' offsets: a partial group is resumed at least once and trained once. A prefix whose oldest
  token is more than ``partial_max_lag`` versions behind is dropped as stale (its record dead-lettered as
  ``StalePartial`` with the reason, counted in ``producer/partials_stale``) and its prompt regenerated from scratch
  (``attempt + 1``). A prefix too large for
  one record is not sent: its prompt is re-queued as without the setting. The failpoint
  ``producer.after_partials`` kills the process after the commit, before anything is resumed.
  A producer started without ``producer.partial_max_lag`` while partial groups wait on the topic refuses to start
  (:func:`producers.parts.check_partials_drained`): it would never read them.
- Heartbeats report the number of generated batches in ``step``.
- Weights change only between batches (with ``producer.inflight_updates``, also between decode steps: each token
  records the version that produced it), after the whole version was fetched and verified; a version that fails
  verification or does not fit the model is logged with the reason and skipped (the same manifest is not retried;
  a version re-published with another payload is), and the producer loads the newest verified version above the
  one it holds instead (v3 corrupt, v2 complete: v2), else continues on its version. At start-up the producer
  first catches up with the newest complete version the same way.
- Processing runs inside ``source.process_span("generate", batch)``, so rollouts carry the prompts' trace context.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from producers.budget import Budget
from producers.config import ProducerConfig
from producers.engines.base import GenerationEngine
from producers.parts import build_backpressure, build_epoch_gate, build_turns, check_partials_drained
from producers.step import (
    EarlyStop, GroupSink, StepResult, Turns, check_prompts, plan_batch, produce_rollouts,
)
from producers.publish import dead_letter, dead_letter_replays, group_sender, publish, publish_partials
from producers.stale_feed import StaleFeed, inheritance
from producers.weights_follower import ProducerStats, WeightsFollower, inflight_hook, make_follower
from schemas import group_id_for
from stream_rl.config.shared import SharedConfig
from stream_rl.runtime import failpoints

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProducerDeps:
    """What a caller hands :func:`run_producer` instead of building it (tests do); None: the production one."""

    engine: GenerationEngine | None = None
    """A loaded engine to reuse, closed by its owner; None: one built from ``pcfg``, closed on return."""
    stats: ProducerStats | None = None
    """Updated live (a caller can watch the progress) and returned; None: a new one."""


def run_producer(shared: SharedConfig, pcfg: ProducerConfig, stop_event: threading.Event | None = None,
                 max_batches: int | None = None, *, deps: ProducerDeps | None = None) -> ProducerStats:
    """Generate rollouts for prompts until ``stop_event`` is set or ``max_batches`` batches were produced.

    ``shared``: the shared sections (the role reads ``weights`` and ``data``, the chat template of multi-turn
    replies); ``pcfg``: the producer's own section (``producer``)."""
    from producers.engines import build_engine
    from stream_rl.telemetry.role import RoleTelemetry
    from stream_rl.transport.client import Transport

    deps = deps if deps is not None else ProducerDeps()
    turns = build_turns(pcfg, shared.data)  # a bad producer.environment fails here, before the engine loads
    stop_event = stop_event or threading.Event()
    transport = Transport(shared, "producer")
    transport.ensure_topics()
    check_partials_drained(transport, pcfg)
    engine = deps.engine if deps.engine is not None else build_engine(pcfg)
    if deps.engine is not None:  # build_engine checked its own
        engine.check_sampling(pcfg.sampling())  # producer.stop / stop_token_ids the model cannot produce: refused
    stats = deps.stats if deps.stats is not None else ProducerStats()
    stats.version = engine.version
    sink = transport.sink()
    group = transport.names.group("producers")
    durable = pcfg.partial_max_lag is not None  # durable partial rollouts: the producers' group reads them too
    source = transport.source([transport.names.prompts] + ([transport.names.partials] if durable else []), group,
                              ("prompt", "partial_group") if durable else "prompt", sink,
                              pause_when=lambda: telemetry.paused)  # alerts: "pause" (telemetry is built below)
    follower = make_follower(transport, shared.weights, pcfg, engine, stats)
    stats.start_version = engine.version  # after the start-up catch-up: the backpressure budget counts from here
    budget, stale = build_backpressure(transport, pcfg, follower, engine)
    telemetry = RoleTelemetry(shared, "producer", transport, group=group, topics=[transport.names.prompts])
    telemetry.attach(source, sink).set_ready(model_loaded=True, version=engine.version)
    if follower is not None and pcfg.inflight_updates:
        engine.set_weights_hook(inflight_hook(follower, engine, telemetry, stats), pcfg.inflight_check_every)
    batch = _PromptBatcher(source, sink, engine, pcfg, pcfg.producer_id or transport.instance_id,
                     transport.names.rollouts)
    batch.gate = build_epoch_gate(transport, source, pcfg) if pcfg.epoch_order else None
    batch.turns = turns
    batch.hold = (inheritance(transport, source, batch.producer_id, follower, budget, stats)
                  if budget.share is not None else None)  # the groups its predecessor left in flight
    if durable:
        batch.partials_topic = transport.names.partials
    try:
        while not stop_event.is_set() and (max_batches is None or stats.batches < max_batches):
            _iterate(batch, follower, budget, stale, stats, telemetry)
    except Exception as exc:
        telemetry.error(type(exc).__name__)
        raise
    finally:
        for closable in (telemetry, follower.receiver if follower else None, stale, source, sink,
                         batch.gate.reader if batch.gate else None):
            if closable is not None:
                closable.close()
        engine.set_weights_hook(None, 0)  # a reused engine must not call into the closed receiver
        if deps.engine is None:
            engine.close()
    return stats


def _iterate(batch: _PromptBatcher, follower: WeightsFollower | None, budget: Budget, stale: StaleFeed | None,
             stats: ProducerStats, telemetry) -> None:
    """One iteration (the module docstring's): alerts, newer weights, stale groups returned to the budget, then
    either wait for newer weights (over budget) or handle one batch."""
    engine, pcfg = batch.engine, batch.pcfg
    telemetry.tick()  # alerts: "stop" ends here, after the previous batch was committed
    telemetry.check_stop()
    if follower is not None and stats.batches % pcfg.weights_check_every_batches == 0:
        follower.update()
        telemetry.set_version(engine.version)
    if follower is not None and follower.held_step is not None:  # also after an update in flight or a wait
        budget.held(engine.version, follower.held_step)
    if stale is not None:
        stats.groups_returned += budget.returned_stale(stale.poll())
    if budget.over(engine.version, time.monotonic()) and not (batch.gate and batch.gate.finishing()):
        follower.update(timeout_s=pcfg.poll_timeout_s, wait_for_newer=True)  # backpressure
        return
    result = batch.run_once(stats, telemetry)
    if result is not None:
        budget.charge({r.group_id: r.group_size for r in result.rollouts},
                      {r.group_id: r.attempt for r in result.rollouts})
        stats.budget_resets = budget.resets
        _observe(telemetry, result, follower, engine)
        if batch.turns is not None:  # each environment's episodes by outcome, in heartbeats (`stream-rl status`)
            telemetry.step_metrics = {**telemetry.step_metrics, **batch.turns.make_env.health_metrics()}


class _PromptBatcher:
    """One iteration over polled prompts: dead-letter the rejected ones or generate for the accepted ones (see
    :func:`producers.step.plan_batch`), then commit; records after a run wait in ``carry`` (uncommitted)."""

    def __init__(self, source, sink, engine: GenerationEngine, pcfg: ProducerConfig, producer_id: str, topic: str):
        self.source, self.sink, self.engine, self.pcfg = source, sink, engine, pcfg
        self.producer_id, self.topic = producer_id, topic
        self.carry: list = []
        self._committed: dict = {}  # (topic, partition) -> the offset last committed by this process
        self.gate = None  # producers.epoch_gate.EpochGate: epoch order across partitions (producer.epoch_order)
        self.turns: Turns | None = None  # multi-turn episodes (producer.environment)
        self.hold = None  # () -> bool after each poll: True keeps the batch for later (stale_feed.inheritance)
        self.aborted: set[tuple] = set()  # (topic, partition, offset) of prompts aborted in the last batch
        self.partials_topic: str | None = None  # producer.partial_max_lag: cut groups' prefixes go there
        self.partials: list = []  # partial group records polled with the prompts, resumed first

    def run_once(self, stats: ProducerStats, telemetry) -> StepResult | None:
        """Handle one batch; the StepResult when rollouts were generated (None: nothing or only dead letters)."""
        records = self._next_records()
        if self.partials:  # the prompts polled with them wait in the carry (uncommitted) for the next iteration
            self.carry = sorted(self.carry + records, key=_position)
            return self._resume(stats, telemetry)
        if not records:
            self.sink.flush()  # dead letters of a poll with no valid prompt
            self._commit(telemetry)
            return None
        if self.hold is not None and self.hold():  # over budget after all: carried, uncommitted, generated later
            self.carry = sorted(self.carry + records, key=_position)
            return None
        pcfg = self.pcfg
        _, rejected = check_prompts([r.value for r in records], self.engine, max_new_tokens=pcfg.max_new_tokens,
                                    group_size=pcfg.group_size, max_group_size=pcfg.max_group_size)
        plan = plan_batch([(r.topic, r.partition) for r in records], [x.index for x in rejected])
        self.carry = [records[i] for i in plan.carry]
        if plan.reject:  # committed before anything is generated: a restart never dead-letters them again
            reasons = {x.index: x.reason for x in rejected}
            for i in plan.reject:
                dead_letter(self.source, records[i], reasons[i])
            stats.rejected_prompts += len(plan.reject)
            self.sink.flush()
            self._commit(telemetry)
            return None
        todo = [records[i] for i in plan.generate]
        with self.source.process_span("generate", todo, {"stream_rl.producer_id": self.producer_id}):
            sent: set[str] = set()  # groups already sent from inside the generation (producer.stream_groups)
            on_group = group_sender(self.sink, self.topic, sent) if pcfg.stream_groups else None
            result = _generate(todo, self.engine, pcfg, self.producer_id, self.turns, on_group,
                               _early_stop(pcfg, todo, self.aborted, self.partials_topic is not None))
            kept = publish_partials(result, self.sink, self.partials_topic)  # flushed with the rollouts below
            drain = getattr(self.turns.make_env, "drain_replayed", None) if self.turns is not None else None
            if drain is not None:  # failed plays whose groups were played again: dead letters, in the same flush
                dead_letter_replays(self.source, todo, drain())
            publish(result, todo, self.source, self.sink, self.topic, sent)
        failpoints.hit("producer.after_send")  # recovery drills: rollouts on the broker, prompts not committed
        cut = [todo[i] for i in result.aborted]  # a cut group whose prefixes are on the broker is not re-queued
        self._requeue([r for r in cut if group_id_for(r.value.prompt_id, r.value.epoch) not in kept])
        self._commit(telemetry)
        stats.partials_published += len(kept)
        if kept:  # recovery drills: the prefixes on the broker, their prompts committed, nothing resumed yet
            failpoints.hit("producer.after_partials")
        _account(stats, result, self.engine)
        telemetry.set_step(stats.batches)  # heartbeats report the batch counter in `step`
        return result

    def _requeue(self, aborted: list) -> None:
        """Carry the prompts whose groups were aborted (producer.oversample / abort_after_s) into the next batch,
        uncommitted and ahead of what follows them in their partition; each is protected from a second abort."""
        self.aborted = {_position(r) for r in aborted}
        if aborted:
            log.info("re-queued %d prompt(s) whose groups were cut at the batch's tail", len(aborted))
            self.carry = sorted(self.carry + aborted, key=_position)

    def _next_records(self) -> list:
        """The carried records of partitions still assigned, else a new poll; then what the epoch gate admits
        (the carry is rebuilt from these by :meth:`run_once`)."""
        if self.carry:
            assigned = self.source.assignment()
            self.carry = [r for r in self.carry if (r.topic, r.partition) in assigned]
        if self.carry and not self.source.paused:
            records, self.carry = self.carry, []
        else:
            records = self.source.poll(self.pcfg.poll_timeout_s, max_records=self.pcfg.prompts_per_batch)
            self.partials = [r for r in records if r.topic == self.partials_topic]
            records = [r for r in records if r.topic != self.partials_topic]
        return self.gate.admit(records) if self.gate is not None else records

    def _resume(self, stats: ProducerStats, telemetry) -> StepResult:
        """Complete the polled partial groups (:mod:`producers.partials`), send and flush them, then commit (every
        partials offset polled, the prompts up to the first carried one): a crash before the commit resumes them
        again under the same rollout ids (dropped downstream as duplicates)."""
        from producers.partials import resume_partials

        records, self.partials, pcfg = self.partials, [], self.pcfg
        with self.source.process_span("resume", records, {"stream_rl.producer_id": self.producer_id}):
            result = resume_partials([r.value for r in records], self.engine, producer_id=self.producer_id,
                                     sampling=pcfg.sampling(), max_new_tokens=pcfg.max_new_tokens,
                                     max_lag=pcfg.partial_max_lag, seed=pcfg.seed)
            publish(result, records, self.source, self.sink, self.topic,
                     group_of=lambda record: record.value.group_id)
        self._commit(telemetry)
        stats.partials_resumed += int(result.metrics["producer/partials_resumed"])
        stats.partials_stale += int(result.metrics["producer/partials_stale"])
        _account(stats, result, self.engine)
        telemetry.set_step(stats.batches)
        return result

    def _commit(self, telemetry) -> None:
        """Commit, per assigned partition, the first carried offset or else the consumer's position (one past
        every record polled: all were generated for or dead-lettered). Sends must be flushed."""
        first_carried: dict = {}
        for r in self.carry:
            first_carried.setdefault((r.topic, r.partition), r.offset)
        offsets = {tp: first_carried.get(tp) if tp in first_carried else self.source.position(*tp)
                   for tp in self.source.assignment()}
        changed = {tp: off for tp, off in offsets.items() if off is not None and self._committed.get(tp) != off}
        if not changed:
            return
        if self.source.commit(changed):
            self._committed.update(changed)
        else:
            log.warning("lost the prompts' partitions before committing: the batch will be regenerated")
            telemetry.error("CommitLost")
            self.carry, self._committed = [], {}


def _observe(telemetry, result: StepResult, follower: WeightsFollower | None, engine: GenerationEngine) -> None:
    """Per batch: generated tokens, generation time, and how many versions the weights held are behind."""
    telemetry.tokens(int(result.metrics.get("producer/response_tokens", 0)))
    telemetry.observe_seconds("generate", float(result.metrics.get("producer/generate_s", 0.0)))
    telemetry.set_version(engine.version)
    fleet = getattr(engine, "fleet", None)
    if fleet is not None:  # the server engine: each server's health, queue depth and throughput in heartbeats
        from producers.engines.server_fleet import fleet_metrics

        telemetry.step_metrics = fleet_metrics(fleet())
    if follower is not None and follower.newest_seen >= 0:
        telemetry.observe_staleness([max(0, follower.newest_seen - engine.version)])






def _generate(records, engine: GenerationEngine, pcfg: ProducerConfig, producer_id: str,
              turns: Turns | None = None, on_group: GroupSink | None = None,
              early_stop: EarlyStop | None = None) -> StepResult:
    return produce_rollouts([r.value for r in records], engine, producer_id=producer_id,
                            sampling=pcfg.sampling(), max_new_tokens=pcfg.max_new_tokens, seed=pcfg.seed,
                            group_size=pcfg.group_size, max_group_size=pcfg.max_group_size, turns=turns,
                            on_group=on_group, early_stop=early_stop)


def _position(record) -> tuple:
    return record.topic, record.partition, record.offset


def _early_stop(pcfg: ProducerConfig, records, aborted_before: set[tuple],
                keep_partials: bool = False) -> EarlyStop | None:
    """``producer.oversample`` / ``abort_after_s`` for a batch of ``records``, the ones aborted last time protected
    (``keep_partials``: the cut groups' prefixes are returned, producer.partial_max_lag)."""
    if pcfg.oversample == 0 and pcfg.abort_after_s is None:
        return None
    protected = frozenset(i for i, r in enumerate(records) if _position(r) in aborted_before)
    return EarlyStop(pcfg.oversample, pcfg.abort_after_s, protected, keep_partials)


def _account(stats: ProducerStats, result: StepResult, engine: GenerationEngine) -> None:
    stats.groups += len({r.group_id for r in result.rollouts})
    stats.batches += 1
    stats.prompts += int(result.metrics.get("producer/prompts", 0))
    stats.rollouts += len(result.rollouts)
    stats.rejected_prompts += len(result.rejected)
    stats.version = engine.version
    log.info("producer batch %s", json.dumps({**result.metrics, "time": time.time()}, sort_keys=True))
