"""``stream-rl train``: the trainer role's loop, a thin shell around the batcher and :func:`train_step`.

Consumes: ``ScoredRollout`` records from every partition of ``names.scored``, assigned explicitly (no group
membership; the group ``{prefix}.{run}.trainer`` only holds the committed offsets that tools read), and the
``MemberRejected`` notices scorers write there for rollouts they dead-lettered.
Produces: ``StaleRollout`` records on ``names.stale`` (key ``group_id``) and re-queued ``Prompt`` records on
``names.prompts`` (key ``prompt_id``); dead letters on ``names.dlq`` for records the model cannot take;
policy versions through :class:`~stream_rl.weights.WeightsPublisher`
(floating tensors in ``Agreements.weights_dtype``: ``producer.dtype``, the dtype the producers run, handed over by
the CLI; with ``trainer.lora`` the adapters only);
one JSON line of metrics per step in ``run_dir/metrics.jsonl``; one line per step in ``run_dir/trained.jsonl``
naming the rollouts it trained (``{"step", "version", "rollout_ids"}``, ``version`` = the policy version the
batch was trained at; a step that applied no update has ``rollout_ids: []``, ``skipped_ids`` and ``skipped``,
the reason); ``run_dir/requeued.jsonl`` (:mod:`~consumers.trainer.history`); checkpoints in
``trainer.checkpoint_dir`` (default ``run_dir/checkpoints``), with ``trainer.keep_best`` the best evaluated
version in its ``best/`` (:mod:`~consumers.trainer.keep_best`); with ``telemetry.trackers``, each metrics row (and
the evaluations on the run's evals topic) to the experiment trackers, queued, never blocking a step
(:mod:`stream_rl.telemetry.trackers.fanout`).

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
            (any other step: sink.flush() ─> commit safe offsets: the group's offsets follow the trainer)
From ``train_step`` on, ``Trainer._step`` runs one method per phase: ``_train``, ``_record`` (trained or
dropped), ``_judge``, ``_broadcast``, ``_write_row``, then :class:`~consumers.trainer.progress.Progress`
``checkpoint_if_due`` (or ``commit_progress``): checkpoints and commits live in :mod:`~consumers.trainer.progress`.

Guarantees:
- The checkpoint is the truth about progress: every partition is assigned at start and positioned at the
  checkpoint's offset, or at the broker's first offset without one (:mod:`~consumers.trainer.positions`: never
  a committed offset or ``auto_offset_reset``; an offset the broker no longer has stops the trainer unless
  ``trainer.accept_offset_loss``), and the checkpoint's dedup ledger keeps any rollout id from being trained
  twice. Safe offsets are recorded (checkpointed or committed) only after ``sink.flush()``, so every stale
  record, re-queued prompt and dead letter below them is on the broker.
- The consumer group's committed offsets are the safe offsets after the last step (a checkpoint's after a
  checkpoint step or a clean stop): never read back by the trainer, they tell restarted producers which groups
  are still in flight (:func:`producers.stale_feed.groups_in_flight`) and ``stream-rl status`` the lag. After a
  crash they may be ahead of the checkpoint the resumed trainer reads from.
- Nothing the model cannot take reaches ``train_step``: it is dead-lettered and its group dropped at once, as is
  a group a scorer or the transport edge dead-lettered a member of (:mod:`~consumers.trainer.intake`).
- A step that applied no update (non-finite loss or gradient norm) trains nothing: its rollouts stay out of the
  ledger and ``trained.jsonl``, go to the stale topic with the reason, and their prompts are re-queued; its
  metrics row is written (the ``loss_nonfinite`` alert sees it).
- A (prompt, epoch, attempt) is re-queued once, also across restarts (the re-queue log), and a prompt at most
  ``trainer.max_requeues`` times.
- Versions never go backwards or repeat with different weights, also across a resume
  (:mod:`~consumers.trainer.versions`).
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
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from consumers.trainer.admit import ModelLimits
from consumers.trainer.batcher import Batcher, Group, rollout_lag
from consumers.trainer.config import TrainerConfig
from consumers.trainer.history import REQUEUE_LOG, append_line, metrics_row, read_requeues, truncate_steps
from consumers.trainer.intake import Intake
from consumers.trainer.keep_best import KeepBest
from consumers.trainer.lineage import Lineage
from consumers.trainer.positions import assign_and_position, assigned_source
from consumers.trainer.progress import Progress
from consumers.trainer.ranks import SOLO, Command, Ranks
from consumers.trainer.replica import restore, run_follower, step_payload
from consumers.trainer.rollout_metrics import rollout_metrics
from consumers.trainer.telemetry_names import exported_metrics, step_alert_values
from consumers.trainer.tensors import build_batch
from consumers.trainer.train_step import TrainState, skip_reason, train_step
from consumers.trainer.versions import PolicyVersions, check_fresh
from stream_rl.alerts.monitor import AlertStop
from stream_rl.config.shared import Agreements, SharedConfig, checkpoint_root
from stream_rl.telemetry.role import RoleTelemetry
from stream_rl.telemetry.trackers.fanout import Trackers
from stream_rl.transport.topics import TopicNames

log = logging.getLogger(__name__)


def trainer_group(cfg) -> str:
    """The trainer's consumer group of this run: ``{prefix}.{run}.trainer``."""
    return TopicNames.from_config(cfg.topics).group("trainer")


@dataclass
class StepRun:
    """What one step's phases hand each other (:meth:`Trainer._step`)."""

    groups: list[Group]
    wait_s: float  # since the previous step: waiting for complete groups
    started: float = field(default_factory=time.monotonic)
    metrics: dict[str, float] = field(default_factory=dict)  # rollout metrics + train_step's, then the timings
    lags: list[int] = field(default_factory=list)  # per rollout, at the version it was trained at
    trace: Any = None  # the train-step span's headers: the step's later sends continue it
    train_s: float = 0.0
    broadcast_s: float = 0.0
    sent_bytes: int = 0
    stop: AlertStop | None = None  # a "stop" alert from judging: raised after the metrics row

    def __post_init__(self) -> None:
        self.records = [r for g in self.groups for r in g.records.values()]
        self.scored = [r.value for r in self.records]
        self.tokens = sum(s.rollout.response_length for s in self.scored)


class Trainer:
    """One trainer process: transport, model, engine, batcher, intake, versions (see the module docstring)."""

    def __init__(self, cfg: SharedConfig, tcfg: TrainerConfig, resume: bool = False, ranks: Ranks = SOLO,
                 agreements: Agreements = Agreements()):
        """``cfg``: the shared sections; ``tcfg``: the trainer's own section (``trainer``); ``agreements``: what
        it follows of the other roles' sections (the broadcast dtype, the evaluator's cadence)."""
        from stream_rl.transport.client import Transport

        self.cfg, self.tcfg, self.ranks = cfg, tcfg, ranks
        if self.tcfg.model_dir is None:
            raise ValueError("trainer.model_dir is not set: point it at the initial policy's directory")
        _seed_everything(self.tcfg.seed)
        self.transport = Transport(cfg, "trainer")
        self.transport.ensure_topics()
        if not resume:  # a fresh trainer (version 0) continues a run another trainer wrote only on purpose
            check_fresh(self.transport, cfg.weights, 0)
        self.names = self.transport.names
        self.telemetry = RoleTelemetry(cfg, "trainer", self.transport, group=trainer_group(cfg),
                                       topics=[self.names.scored])
        self.root = checkpoint_root(cfg.run_dir, tcfg.checkpoint_dir)
        self.metrics_path = Path(cfg.run_dir) / "metrics.jsonl"
        self.trained_path = Path(cfg.run_dir) / "trained.jsonl"
        self.requeue_path = Path(cfg.run_dir) / REQUEUE_LOG
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        replica = restore(cfg, tcfg, ranks, resume)
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
        self.versions = PolicyVersions(cfg.weights, tcfg.lora, agreements.weights_dtype, self.transport, self.sink,
                                       self.engine, ranks)
        if resume:
            self.versions.reconcile(self.state)
            self.batcher.lineage = Lineage.of(self.state.lineage)
        self.source = assigned_source(self.transport, trainer_group(cfg), ("scored_rollout", "member_rejected"),
                                      self.sink, keep_rejections=True,  # edge dead letters: seen, their groups dropped
                                      pause_when=lambda: self.telemetry.paused)  # alerts: "pause"
        self.intake = Intake(self.batcher, self.limits, self.source, self.sink, self.names, self.requeue_path)
        self.start = self._position(ckpt.offsets if ckpt else {})
        self.progress = Progress(self.root, tcfg, self.state, self.batcher, self.engine, ranks, self.source,
                                 self.sink, self.start)  # checkpoints and commits (progress.py)
        self.telemetry.attach(self.source, self.sink)
        self.telemetry.set_ready(model_loaded=True, version=self.state.version)
        # experiment trackers (telemetry.trackers): a resumed run continues its tracker runs after the checkpoint
        self.trackers = Trackers.open(cfg, (ckpt.step if ckpt else 0) if resume else None,
                                      self.transport)  # + the evaluations on the evals topic
        self.best = KeepBest.open(tcfg, agreements, self.transport, self.root, self.engine,
                                  ranks)  # trainer.keep_best (keep_best.py)
        if ckpt is None:
            self.best.hold(self.state.version, self.state.step)  # the initial weights, when evaluated
        self.best.poll()  # evaluations that arrived while no trainer ran

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

    def _position(self, offsets: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Assign every scored partition and seek it (:mod:`consumers.trainer.positions`); on an error, close
        what this process opened so that it exits cleanly."""
        reader = self.transport.reader()
        try:
            return assign_and_position(self.source, reader, self.names.scored, offsets,
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
            self.progress.checkpoint_after_stop()
            raise
        except Exception as exc:
            self.telemetry.error(type(exc).__name__)
            raise
        if self.state.step > self.progress.last_checkpoint_step:
            self.progress.checkpoint()
        return self.state

    def _loop(self, stop_event: threading.Event | None) -> None:
        waiting_since = time.monotonic()
        while not (stop_event is not None and stop_event.is_set()) and not self._finished():
            self.telemetry.tick()
            for record in self.source.poll(self.tcfg.poll_timeout_s):
                self.intake.admit(record, self.state.version)  # its drops continue the record's trace
            self.intake.edge_rejections(self.state.version)
            groups = self.batcher.take(self.tcfg.groups_per_step)
            if groups is None:
                if self.sink.pending:
                    self.sink.flush()
                self.ranks.heartbeat()
                continue
            self._step(groups, wait_s=time.monotonic() - waiting_since)
            waiting_since = time.monotonic()

    def _finished(self) -> bool:
        return self.tcfg.max_steps is not None and self.state.step >= self.tcfg.max_steps

    def _step(self, groups: list[Group], wait_s: float) -> None:
        """One step, phase by phase (the module docstring's iteration). Judging comes before the broadcast, so a
        "stop" alert publishes nothing (NaN weights never leave); its step still gets its metrics row."""
        run = StepRun(groups, wait_s)
        self._train(run)
        self._record(run)
        self._judge(run)
        if run.stop is None:
            self._broadcast(run)
        self._write_row(run)
        if run.stop is not None:
            raise run.stop
        self.best.poll()  # trainer.keep_best: judge the evaluations published since the last step
        self.progress.checkpoint_if_due()
        if self.progress.last_checkpoint_step != self.state.step:
            self.progress.commit_progress()

    def _train(self, run: StepRun) -> None:
        """``train_step`` on the step's rollouts, in the span "train-step" linked to every rollout; the other
        ranks are sent the step first. Advances ``state.step``."""
        scored = run.scored
        with self.source.process_span("train-step", run.records, {
                "stream_rl.step": self.state.step + 1,  # the step being trained, as metrics.jsonl numbers it
                "stream_rl.policy_version": self.state.version,
                "stream_rl.rollouts": len(scored),
                "stream_rl.response_tokens": run.tokens}):
            self.ranks.send(Command.STEP, step_payload(self.state, scored) if self.ranks.world > 1 else b"")
            batch = build_batch(scored, self.pad_id)
            run.lags = [max(rollout_lag(s, self.state.version, self.batcher.lineage), 0) for s in scored]
            run.metrics = rollout_metrics(scored, self.state.version, self.tcfg.success_threshold, run.lags,
                                          time.time())
            run.metrics.update(train_step(self.engine, batch, self.tcfg, self.state))
            run.trace = self.source.trace_headers()  # the step's sends below continue this span
        run.train_s = time.monotonic() - run.started

    def _record(self, run: StepRun) -> None:
        """Settle the step: its groups are trained, or, when no update was applied, dropped with the reason and
        never counted as trained; then its ``trained.jsonl`` line. Only a trained step counts tokens and
        staleness."""
        ids = [s.rollout_id for s in run.scored]
        line: dict[str, Any] = {"step": self.state.step, "version": self.state.version, "rollout_ids": ids}
        trained = run.metrics.get("optim/updates", 1.0) > 0
        if trained:
            self.batcher.mark_trained(run.groups)
        else:
            reason = skip_reason(self.state.step, run.metrics)
            log.warning("%s: its %d rollouts go to the stale topic and their prompts are re-queued", reason,
                        len(ids))
            self.intake.send(self.batcher.drop_skipped(run.groups, self.state.version, reason), run.trace)
            line.update({"rollout_ids": [], "skipped_ids": ids, "skipped": reason})
        append_line(self.trained_path, line)
        if trained:
            self.telemetry.tokens(run.tokens)
            self.telemetry.observe_staleness(run.lags)

    def _judge(self, run: StepRun) -> None:
        """The alerts judge the step before its weights can be published; a "stop" alert is kept in ``run.stop``
        and raised once the step's metrics row is written."""
        try:
            self.telemetry.step_done(self.state.step, step_alert_values(run.metrics))
        except AlertStop as exc:
            run.stop = exc

    def _broadcast(self, run: StepRun) -> None:
        """Every ``broadcast_every`` steps: version += 1, publish it (span "broadcast", continuing the step's
        trace), then expire the groups now too old."""
        if self.state.step % self.tcfg.broadcast_every != 0:
            return
        t0 = time.monotonic()
        self.state.version += 1
        with self.source.process_span_of("broadcast", run.trace, {"stream_rl.policy_version": self.state.version}):
            run.sent_bytes = self.versions.broadcast(self.state)
            self.best.hold(self.state.version, self.state.step)
            self.intake.send(self.batcher.expire(self.state.version))
        run.broadcast_s = time.monotonic() - t0

    def _write_row(self, run: StepRun) -> None:
        """The step's ``metrics.jsonl`` row with its timings (``time/checkpoint_s``: the checkpoint written after
        the previous row), and the stage durations."""
        run.metrics.update({"time/wait_s": run.wait_s, "time/broadcast_s": run.broadcast_s,
                            "weights/sent_bytes": run.sent_bytes, "time/checkpoint_s": self.progress.checkpoint_s,
                            "time/step_s": time.monotonic() - run.started})
        self._write_metrics(run.metrics, run.scored)
        for stage, seconds in (("train", run.train_s), ("broadcast", run.broadcast_s), ("wait", run.wait_s),
                               ("step", run.metrics["time/step_s"])):
            self.telemetry.observe_seconds(stage, seconds)

    # -- outputs ------------------------------------------------------------------------------------------------

    def _write_metrics(self, metrics: dict[str, float], scored: Sequence = ()) -> None:
        row = metrics_row(self.state.step, self.state.version, metrics, self.batcher)
        append_line(self.metrics_path, row)
        self.trackers.log_step(row, scored)  # queued: a tracker never blocks the step
        self.telemetry.set_version(self.state.version)
        self.telemetry.row_written(row, exported_metrics(row))

    def close(self) -> None:
        stopped = not self.ranks.broken
        if stopped:
            self.ranks.send(Command.STOP)
        self.ranks.close(together=stopped)
        self.source.close()
        self.sink.close()
        self.best.poll()
        self.best.close()
        self.trackers.close()
        self.telemetry.close()
        self.transport.tracing.shutdown()


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def run_trainer(cfg: SharedConfig, tcfg: TrainerConfig, stop_event: threading.Event | None = None,
                resume: bool = False, *, agreements: Agreements = Agreements()) -> TrainState | None:
    """Train until ``stop_event`` is set or ``trainer.max_steps`` steps are done; returns the final state.
    ``cfg``: the shared sections; ``tcfg``: the trainer's own section; ``agreements``: see :class:`Trainer`.

    Under torchrun (``WORLD_SIZE`` > 1) rank 0 is the trainer of this module and every other rank runs
    :func:`~consumers.trainer.replica.run_follower` (returns None)."""
    from consumers.trainer.engines import resolve_device

    use_cuda = resolve_device(tcfg.device).type == "cuda"
    ranks = Ranks.from_env(tcfg.collective_timeout_s, use_cuda=use_cuda)
    if ranks.world > 1:
        from stream_rl.launch.orchestrator import die_with_parent

        die_with_parent()  # no rank outlives its launcher (the leader then checkpoints and stops the followers)
    if not ranks.leader:
        run_follower(cfg, tcfg, ranks, resume)
        return None
    trainer = Trainer(cfg, tcfg, resume=resume, ranks=ranks, agreements=agreements)
    try:
        return trainer.run(stop_event)
    finally:
        trainer.close()
