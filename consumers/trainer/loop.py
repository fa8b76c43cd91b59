"""``stream-rl train``: the trainer role's loop, a thin shell around the batcher and :func:`train_step`.

Consumes: ``ScoredRollout`` records from every partition of ``names.scored``, assigned explicitly (no group
membership; the group ``{prefix}.{run}.trainer`` only holds the committed offsets that tools read), and the
``MemberRejected`` notices scorers write there for rollouts they dead-lettered.
Produces: ``StaleRollout`` records on ``names.stale`` (key ``group_id``) and re-queued ``Prompt`` records on
``names.prompts`` (key ``prompt_id``); dead letters on ``names.dlq`` for records the model cannot take;
policy versions through :class:`~stream_rl.weights.WeightsPublisher`
(floating tensors in ``producer.dtype``, the dtype the generators run; with ``trainer.lora`` the adapters only);
one JSON line of metrics per step in ``run_dir/metrics.jsonl``; one line per step in ``run_dir/trained.jsonl``
naming the rollouts it trained (``{"step", "version", "rollout_ids"}``, ``version`` = the policy version the
batch was trained at; a step that applied no update has ``rollout_ids: []``, ``skipped_ids`` and ``skipped``,
the reason); ``run_dir/requeued.jsonl`` (:mod:`~consumers.trainer.history`); checkpoints in
``trainer.checkpoint_dir`` (default ``run_dir/checkpoints``).

One iteration::

    poll ─> admit (token ids, lengths vs the model; a reject ─> DLQ + its group dropped to stale + re-queue)
         ─> batcher.add (dedup, staleness ─> stale + re-queue sends, flushed, then logged) ─> take N whole groups
         ─> train_step (span "train-step" linked to every rollout) ─> mark trained (or, if no update was
            applied: the groups to stale + re-queue, never trained) ─> trained.jsonl line
         ─> alerts judge the step (telemetry.step_done; a "stop" alert skips the broadcast: NaN weights never
            leave, the row is written, a final checkpoint only if the weights are finite, AlertStop -> exit 3)
         ─> every broadcast_every steps: version += 1, publish, expire groups now too old
         ─> metrics.jsonl row
         ─> every checkpoint_every steps: sink.flush() ─> checkpoint(safe offsets, ledger) ─> commit safe offsets

Guarantees:
- The checkpoint is the truth about progress: every partition is assigned at start and positioned at the
  checkpoint's offset, or at the broker's first offset without one (:mod:`~consumers.trainer.positions`: never
  a committed offset or ``auto_offset_reset``; an offset the broker no longer has stops the trainer unless
  ``trainer.accept_offset_loss``), and the checkpoint's dedup ledger keeps any rollout id from being trained
  twice. Safe offsets are recorded only after ``sink.flush()``, so every stale record, re-queued prompt and dead
  letter below them is on the broker.
- Nothing the model cannot take reaches ``train_step`` (:mod:`~consumers.trainer.admit`): such a record is
  dead-lettered with the reason and the role continues; its group is dropped at once (stale + re-queue), so it
  never pins its partition's safe offset. So is a group a scorer's ``MemberRejected`` names, or one named by a
  record the transport edge dead-lettered here (undecodable, keyed by its group id).
- A step that applied no update (non-finite loss or gradient norm) trains nothing: its rollouts stay out of the
  ledger and ``trained.jsonl``, go to the stale topic with the reason, and their prompts are re-queued; its
  metrics row is written (the ``loss_nonfinite`` alert sees it).
- A (prompt, epoch, attempt) is re-queued once, also across restarts (the re-queue log), and a prompt at most
  ``trainer.max_requeues`` times.
- Versions never go backwards or repeat with different weights: on resume the newest published manifest is read;
  if it is newer than the checkpoint (weights published after the last checkpoint were lost), the trainer
  republishes its weights as the next version, and if the checkpoint's version was never published it is.
- A clean stop (``stop_event`` or ``max_steps``) writes a final checkpoint; a crash loses at most the steps since
  the last one, whose rollouts are re-read and trained again from the restored weights.
- The step's ``trained.jsonl`` line and ``metrics.jsonl`` row are appended before its checkpoint, so every step a
  checkpoint covers has both. ``--resume`` rewrites both files atomically (tmp + rename) keeping only the lines
  with ``step <=`` the checkpoint's step (none without a checkpoint) and dropping a line torn by a crash: what
  survives is the history the restored state contains, each step once, no rollout id in two surviving lines.
  ``time/checkpoint_s`` in a row is therefore the duration of the checkpoint written after the previous row.
- Data-parallel ranks (``stream-rl train --nproc N``, torchrun): this loop is rank 0's alone, so everything above
  holds unchanged; before each step's training, each weight gather (broadcast, finite check) and each checkpoint it
  sends the other ranks the command that keeps them in lockstep (:mod:`consumers.trainer.replica`), and it ends
  them with STOP when it closes. A lost rank surfaces as :class:`~consumers.trainer.ranks.RankFailure`.
- Errors propagate (a broker that does not acknowledge, a model that cannot load, rollouts without reference
  logprobs while ``kl.coef > 0``); the consumer and producer are closed on the way out.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from consumers.trainer.admit import ModelLimits, check_scored
from consumers.trainer.batcher import Batcher, Group, StaleDrop, rollout_lag
from consumers.trainer.checkpoint import prune_checkpoints, save_checkpoint
from consumers.trainer.engines import cast_floating
from consumers.trainer.history import REQUEUE_LOG, append_line, log_requeues, read_requeues, truncate_steps
from consumers.trainer.positions import assign_and_position, assigned_source
from consumers.trainer.lineage import Lineage
from consumers.trainer.ranks import SOLO, Command, Ranks
from consumers.trainer.replica import checkpoint_root, restore, run_follower, step_payload
from consumers.trainer.rollout_metrics import rollout_metrics
from consumers.trainer.step import TrainState, skip_reason, train_step
from consumers.trainer.tensors import build_batch
from schemas import MemberRejected, WeightsManifest
from stream_rl import failpoints
from stream_rl.alerts.monitor import AlertStop
from stream_rl.telemetry.role import RoleTelemetry
from stream_rl.transport.rejections import group_of
from stream_rl.transport.topics import TopicNames

log = logging.getLogger(__name__)


def trainer_group(cfg) -> str:
    """The trainer's consumer group of this run: ``{prefix}.{run}.trainer``."""
    return TopicNames.from_config(cfg.topics).group("trainer")


def _finite(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else None


class Trainer:
    """One trainer process: transport, model, engine, batcher, publisher (see the module docstring)."""

    def __init__(self, cfg, resume: bool = False, ranks: Ranks = SOLO):
        from stream_rl.transport.client import Transport
        from stream_rl.weights import WeightsPublisher

        self.cfg, self.tcfg, self.ranks = cfg, cfg.trainer, ranks
        if self.tcfg.model_dir is None:
            raise ValueError("trainer.model_dir is not set: point it at the initial policy's directory")
        _seed_everything(self.tcfg.seed)
        self.transport = Transport(cfg, "trainer")
        self.transport.ensure_topics()
        self.names = self.transport.names
        self.telemetry = RoleTelemetry(cfg, "trainer", self.transport, group=trainer_group(cfg),
                                       topics=[self.names.scored])
        self.root = checkpoint_root(cfg)
        self.metrics_path = Path(cfg.run_dir) / "metrics.jsonl"
        self.trained_path = Path(cfg.run_dir) / "trained.jsonl"
        self.requeue_path = Path(cfg.run_dir) / REQUEUE_LOG
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.checkpoint_s = 0.0  # duration of the checkpoint written since the last metrics row
        replica = restore(cfg, ranks, resume)
        self.engine, self.pad_id, ckpt = replica.engine, replica.pad_id, replica.checkpoint
        if ckpt is not None:
            log.info("resumed from %s (step %d, version %d) on %d rank(s)", replica.path, ckpt.step, ckpt.version,
                     ranks.world)
        elif resume:
            log.warning("--resume: no complete checkpoint in %s, starting from %s", self.root, self.tcfg.model_dir)
        self.limits = ModelLimits.of(self.engine.module.policy.config, self.tcfg)
        self._restore_state(ckpt, resume)
        if ckpt is not None:
            self.telemetry.restart()  # resumed from a checkpoint
        self.telemetry.set_step(self.state.step)
        self.sink = self.transport.sink()
        self.publisher = WeightsPublisher(self.transport, self.sink, cfg.weights, self.transport.instance_id)
        if resume:
            self._reconcile_version()
        self.source = assigned_source(self.transport, trainer_group(cfg), ("scored_rollout", "member_rejected"),
                                      self.sink)
        self.source.rejections = []  # what the edge dead-letters: offsets seen, groups named are dropped
        self.start = self._position(ckpt.offsets if ckpt else {})
        self.telemetry.attach(self.source, self.sink)
        self.telemetry.set_ready(model_loaded=True, version=self.state.version)

    def _restore_state(self, ckpt, resume: bool) -> None:
        """State, batcher (ledger + every re-queue already sent) and, on resume, the surviving history files."""
        if resume:  # the surviving history: what the restored state contains
            for path in (self.metrics_path, self.trained_path):
                truncate_steps(path, ckpt.step if ckpt is not None else 0)
        self.state = TrainState.from_json(ckpt.state) if ckpt else TrainState(kl_coef=self.tcfg.kl.coef)
        cap, atol = self.tcfg.max_requeues, 0.0 if self.tcfg.dynamic_sampling else None  # "equal": exactly
        self.batcher = (Batcher.from_state(self.tcfg.max_lag, ckpt.ledger, cap, atol) if ckpt
                        else Batcher(self.tcfg.max_lag, cap, atol))
        self.batcher.lineage = Lineage.of(self.state.lineage)
        if resume:  # re-queues sent after the checkpoint are on the broker: never send them again
            for group_id, attempt in read_requeues(self.requeue_path, self.names.prompts).items():
                self.batcher.note_requeued(group_id, attempt - 1)
        self.last_checkpoint_step = self.state.step

    def _position(self, offsets: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Assign every scored partition and seek it (:mod:`consumers.trainer.positions`); on an error, close
        what this process opened so that it exits cleanly."""
        reader = self.transport.reader()
        try:
            return assign_and_position(self.source.consumer, reader, self.names.scored, offsets,
                                       self.tcfg.accept_offset_loss)
        except BaseException:
            for part in (self.source, self.sink, self.telemetry):
                part.close()
            raise
        finally:
            reader.close()

    # -- main loop ----------------------------------------------------------------------------------------------

    def run(self, stop_event: threading.Event | None = None) -> TrainState:
        try:
            self._loop(stop_event)
        except AlertStop:
            self._checkpoint_after_stop()
            raise
        except Exception as exc:
            self.telemetry.error(type(exc).__name__)
            raise
        if self.state.step > self.last_checkpoint_step:
            self._checkpoint()
        return self.state

    def _loop(self, stop_event: threading.Event | None) -> None:
        waiting_since = time.monotonic()
        while not (stop_event is not None and stop_event.is_set()) and not self._finished():
            self.telemetry.tick()
            self.source.paused = self.telemetry.paused
            for record in self.source.poll(self.tcfg.poll_timeout_s):
                self._send_drops(self._admit(record), record.headers)  # drops continue the record's trace
            self._send_drops(self._edge_rejections())
            groups = self.batcher.take(self.tcfg.groups_per_step)
            if groups is None:
                if self.sink.pending:
                    self.sink.flush()
                self.ranks.heartbeat()
                continue
            self._step(groups, wait_s=time.monotonic() - waiting_since)
            waiting_since = time.monotonic()

    def _admit(self, record) -> list[StaleDrop]:
        """Check ``record`` against the model (:mod:`consumers.trainer.admit`): into the batcher, or dead-lettered
        with the reason and its group dropped at once (it could never complete)."""
        if isinstance(record.value, MemberRejected):  # a scorer dead-lettered a member of this group
            notice = record.value
            return self.batcher.reject_member(
                notice.group_id, notice.attempt, f"{notice.rollout_id or 'a rollout'} by {notice.consumer_id} "
                f"({notice.error_type}): {notice.reason}", self.state.version, at=record)
        rejection = check_scored(record.value, self.limits)
        if rejection is None:
            return self.batcher.add(record, self.state.version)
        self.source.dead_letter_record(record, rejection.reason, rejection.error_type)
        return self.batcher.reject(record, self.state.version, rejection.reason)

    def _edge_rejections(self) -> list[StaleDrop]:
        """The records the transport edge dead-lettered in the last poll: each counts as seen (safe offsets move
        past it), and a group one names (decoded, or keyed by a group id) is dropped (it can never complete)."""
        rejections, self.source.rejections = self.source.rejections, []
        drops = []
        for rejection in rejections:
            named = group_of(rejection.value, rejection.key)
            if named is None:
                self.batcher.see(rejection)
                continue
            drops += self.batcher.reject_member(named.group_id, named.attempt, rejection.reason,
                                                self.state.version, at=rejection)
        return drops

    def _finished(self) -> bool:
        return self.tcfg.max_steps is not None and self.state.step >= self.tcfg.max_steps

    def _step(self, groups: list[Group], wait_s: float) -> None:
        started = time.monotonic()
        records = [r for g in groups for r in g.records.values()]
        scored = [r.value for r in records]
        tokens = sum(s.rollout.response_length for s in scored)
        with self.source.process_span("train-step", records, {
                "stream_rl.step": self.state.step + 1,  # the step being trained, as metrics.jsonl numbers it
                "stream_rl.policy_version": self.state.version,
                "stream_rl.rollouts": len(scored),
                "stream_rl.response_tokens": tokens}):
            self.ranks.send(Command.STEP, step_payload(self.state, scored) if self.ranks.world > 1 else b"")
            batch = build_batch(scored, self.pad_id)
            lags = [max(rollout_lag(s, self.state.version, self.batcher.lineage), 0) for s in scored]
            metrics = rollout_metrics(scored, self.state.version, self.tcfg.success_threshold, lags, time.time())
            metrics.update(train_step(self.engine, batch, self.tcfg, self.state))
            step_trace = self.source.trace_headers()  # the step's sends below continue this span
        train_s = time.monotonic() - started
        if self._settle(groups, scored, metrics, step_trace):
            self.telemetry.tokens(tokens)
            self.telemetry.observe_staleness(lags)
        stop = None
        try:  # alerts judge the step before its weights can be published (NaN weights never leave)
            self.telemetry.step_done(self.state.step, metrics)
        except AlertStop as exc:
            stop = exc
        broadcast_s, sent = 0.0, 0
        if stop is None and self.state.step % self.tcfg.broadcast_every == 0:
            t0 = time.monotonic()
            self.state.version += 1
            with self.source.process_span_of("broadcast", step_trace, {"stream_rl.policy_version":
                                                                       self.state.version}):
                sent = self._publish().sent_bytes
                if self.state.version % self.cfg.weights.keep_last == 0:  # GC lists topics: not every version
                    self.publisher.collect_garbage(self.cfg.weights.keep_last)
                self._send_drops(self.batcher.expire(self.state.version))
            broadcast_s = time.monotonic() - t0
        metrics.update({"time/wait_s": wait_s, "time/broadcast_s": broadcast_s, "weights/sent_bytes": sent,
                        "time/checkpoint_s": self.checkpoint_s, "time/step_s": time.monotonic() - started})
        self._write_metrics(metrics)
        for stage, seconds in (("train", train_s), ("broadcast", broadcast_s), ("wait", wait_s),
                               ("step", metrics["time/step_s"])):
            self.telemetry.observe_seconds(stage, seconds)
        if stop is not None:
            raise stop
        self.checkpoint_s = 0.0
        if self.state.step % self.tcfg.checkpoint_every == 0:
            t0 = time.monotonic()
            self._checkpoint()
            self.checkpoint_s = time.monotonic() - t0

    def _settle(self, groups: list[Group], scored: list, metrics: dict[str, float], trace) -> bool:
        """After ``train_step`` (which advanced the step): the step's groups are trained, or, when no update
        was applied, dropped with the reason and never counted as trained. Returns True if trained."""
        ids = [s.rollout_id for s in scored]
        line: dict[str, Any] = {"step": self.state.step, "version": self.state.version, "rollout_ids": ids}
        trained = metrics.get("optim/updates", 1.0) > 0
        if trained:
            self.batcher.mark_trained(groups)
        else:
            reason = skip_reason(self.state.step, metrics)
            log.warning("%s: its %d rollouts go to the stale topic and their prompts are re-queued", reason,
                        len(ids))
            self._send_drops(self.batcher.drop_skipped(groups, self.state.version, reason), trace)
            line.update({"rollout_ids": [], "skipped_ids": ids, "skipped": reason})
        append_line(self.trained_path, line)
        return trained

    # -- outputs ------------------------------------------------------------------------------------------------

    def _send_drops(self, drops: list[StaleDrop], trace=None) -> None:
        """Stale records and re-queued prompts, in a span continuing ``trace`` (the headers of the record or the
        step that caused them); the re-queues are flushed, then logged (never sent twice)."""
        if not drops:
            return
        if trace is not None:
            with self.source.process_span_of("drop", trace):
                self._send_drops(drops)
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

    def _write_metrics(self, metrics: dict[str, float]) -> None:
        counters = {f"batcher/{k}_total": float(v) for k, v in self.batcher.counters.items()}
        row = {"step": self.state.step, "policy_version": self.state.version, "time": time.time(),
               **{k: _finite(v) for k, v in sorted(metrics.items())}, **counters,
               "batcher/buffered_groups": self.batcher.buffered_groups,
               "batcher/ready_groups": self.batcher.ready_groups,
               "data/distinct_prompts": float(self.batcher.ledger.prompts()),
               "data/epoch": float(self.batcher.ledger.top_epoch())}
        append_line(self.metrics_path, row)
        self.telemetry.set_version(self.state.version)
        self.telemetry.row_written(row)

    def _checkpoint(self) -> Path:
        """Flush, checkpoint atomically, prune, then commit the same safe offsets to the consumer group."""
        self.sink.flush()
        offsets = {**self.start, **self.batcher.safe_offsets()}
        self.ranks.send(Command.SAVE)
        path = save_checkpoint(self.root, step=self.state.step, version=self.state.version, engine=self.engine,
                               offsets=offsets, ledger=self.batcher.ledger_state(), state=self.state.to_json())
        prune_checkpoints(self.root, self.tcfg.keep_checkpoints)
        self.last_checkpoint_step = self.state.step
        failpoints.hit("trainer.after_checkpoint")  # recovery drills: a checkpoint whose offsets are not committed
        assigned = {(tp.topic, tp.partition): tp for tp in self.source.consumer.assignment()}
        commit = {assigned[k]: off for k, off in offsets.items() if k in assigned}
        if commit:
            self.source.commit(commit)
        log.info("checkpoint %s (version %d)", path, self.state.version)
        return path

    def _checkpoint_after_stop(self) -> None:
        """A ``stop`` alert: checkpoint the progress unless the weights are no longer finite (a NaN step must not
        become the newest checkpoint a ``--resume`` would load; the last periodic checkpoint stays the newest)."""
        if self.state.step <= self.last_checkpoint_step:
            return
        self.ranks.send(Command.WEIGHTS)
        if all(bool(torch.isfinite(t).all()) for t in self.engine.policy_state_dict().values()):
            self._checkpoint()
        else:
            log.error("stop alert: weights are not finite after step %d, no final checkpoint (newest stays step %d)",
                      self.state.step, self.last_checkpoint_step)

    def _reconcile_version(self) -> None:
        from stream_rl.weights import WeightsReceiver

        receiver = WeightsReceiver(self.transport, self.cfg.weights)
        try:
            latest = receiver.poll_latest(timeout_s=10.0)
        finally:
            receiver.close()
        published = latest.version if latest is not None else -1
        if published == self.state.version:
            return
        if published > self.state.version:
            log.warning("versions up to %d were published after the checkpoint (version %d); republishing the "
                        "checkpoint's weights as version %d (staleness is measured through the checkpoint's "
                        "version, so the backlog stays as fresh as it was)", published, self.state.version,
                        published + 1)
            self.state.lineage.append([self.state.version, published + 1])
            self.state.version = published + 1
            self.batcher.lineage = Lineage.of(self.state.lineage)
        self._publish()

    def _publish(self) -> WeightsManifest:
        """Publish the policy as ``state.version``, in the dtype the generators run (``producer.dtype``)."""
        self.ranks.send(Command.WEIGHTS)
        weights = cast_floating(self.engine.policy_state_dict(), self.cfg.producer.dtype)
        lora = self.tcfg.lora  # a LoRA version carries the adapters only, stamped with (rank, alpha)
        adapter = (lora.rank, lora.alpha) if lora.enabled else None
        return self.publisher.publish(weights, self.state.version, self.state.step, adapter=adapter)

    def close(self) -> None:
        if not self.ranks.broken:
            self.ranks.send(Command.STOP)
        self.ranks.close()
        self.source.close()
        self.sink.close()
        self.telemetry.close()
        self.transport.tracing.shutdown()


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def run_trainer(cfg, stop_event: threading.Event | None = None, resume: bool = False) -> TrainState | None:
    """Train until ``stop_event`` is set or ``trainer.max_steps`` steps are done; returns the final state.

    Under torchrun (``WORLD_SIZE`` > 1) rank 0 is the trainer of this module and every other rank runs
    :func:`~consumers.trainer.replica.run_follower` (returns None)."""
    from consumers.trainer.engines import resolve_device

    use_cuda = resolve_device(cfg.trainer.device).type == "cuda"
    ranks = Ranks.from_env(cfg.trainer.collective_timeout_s, use_cuda=use_cuda)
    if ranks.world > 1:
        from stream_rl.orchestrator import die_with_parent

        die_with_parent()  # no rank outlives its launcher (the leader then checkpoints and stops the followers)
    if not ranks.leader:
        return run_follower(cfg, ranks, resume)
    trainer = Trainer(cfg, resume=resume, ranks=ranks)
    try:
        return trainer.run(stop_event)
    finally:
        trainer.close()
