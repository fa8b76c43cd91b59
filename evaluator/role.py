"""``stream-rl evaluate``: the evaluator role, a thin loop around the evaluation step (:mod:`evaluator.step`).

Consumes: weights manifests/payloads through :class:`~stream_rl.weights.receiver.WeightsReceiver` (group-less,
from the first manifest: the evaluator's progress is the evals topic, not a committed offset), the held-out sets
(``eval.sets``), and, at start, every record of the run's evals topic.
Produces: one ``Evaluation`` record per evaluated version on the evals topic (key ``str(version)``) and its row in
``RUN_DIR/evals.jsonl`` (:class:`~stream_rl.evaluation.ledger.Ledger`); a log line per evaluation and per skip;
heartbeats of role ``evaluator`` on the status topic (:class:`~stream_rl.telemetry.role.RoleTelemetry`: version =
the last version evaluated, step = evaluations done by this process, metrics = that evaluation's, ``eval/...``).

One iteration::

    poll manifests (up to eval.poll_timeout_s) -> plan_next(seen, done)  (stream_rl.evaluation.schedule)
       nothing due -> next iteration
       target v    -> (v > 0) fetch + verify + load v  -> evaluate every set -> publish, ack, append the row
                      skipped due versions -> one warning line naming them (and skipped_versions in the row)

Guarantees:
- It never slows the trainer: it only reads the weights topic, in its own process, and takes the newest due version
  when it is behind (:mod:`stream_rl.evaluation.schedule`).
- A kill -9 at any point neither loses nor duplicates an evaluation: at start it reads the evals topic (what is
  done), completes ``evals.jsonl`` from it, and evaluates what is still due; an evaluation interrupted before its
  record was acknowledged is redone. One evaluator per run (two would evaluate the same versions).
- A version that fails verification or does not fit the model is logged and skipped (never evaluated on a mix).
- Version 0 is the engine's initial weights (the engine settings' ``model_dir``: the CLI hands over the producers'
  section), evaluated first with ``eval.before_train``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from producers.config import ProducerConfig
from evaluator.config import EvalConfig
from evaluator.step import evaluate_sets, load_sets, set_options, tokenize_sets
from schemas import Evaluation
from stream_rl.config.shared import SharedConfig
from stream_rl.telemetry.role import RoleTelemetry

log = logging.getLogger(__name__)


@dataclass
class EvaluatorStats:
    """What one ``run_evaluator`` call did (tests, logs, the CLI's summary)."""

    evaluated: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    rejected_versions: list[int] = field(default_factory=list)
    resumed: list[int] = field(default_factory=list)  # versions found done on the evals topic at start
    rows_restored: int = 0


@dataclass(frozen=True)
class EvaluatorDeps:
    """What a caller hands :func:`run_evaluator` instead of building it; None: the production one."""

    engine: object | None = None
    """A loaded engine at version 0 to reuse (closed by its owner); None: built from the engine settings."""
    stats: EvaluatorStats | None = None
    on_evaluation: Callable[[Evaluation], None] | None = None
    """Called after each evaluation is recorded: the hook for experiment trackers
    (``log_evaluation(step, metrics)``, stream_rl.telemetry)."""


def run_evaluator(shared: SharedConfig, ecfg: EvalConfig | None, engine_cfg: ProducerConfig,
                  stop_event: threading.Event | None = None, max_evaluations: int | None = None, *,
                  deps: EvaluatorDeps | None = None) -> EvaluatorStats:
    """Evaluate due versions until ``stop_event`` is set or ``max_evaluations`` were recorded by this call.

    ``shared``: the shared sections (``weights``, ``data``); ``ecfg``: the evaluator's own section (``eval``; None
    is refused); ``engine_cfg``: the generation engine's settings, the producers' (``producer``), handed over by
    the CLI so that the evaluator generates as the producers do."""
    from producers.engines import build_engine
    from stream_rl.evaluation.ledger import Ledger, ensure_evals_topic, read_done
    from stream_rl.evaluation.scoring import load_extractor, load_reward
    from stream_rl.transport.client import Transport
    from stream_rl.weights.receiver import WeightsReceiver

    deps = deps or EvaluatorDeps()
    if ecfg is None:
        raise ValueError("stream-rl evaluate needs an [eval] section (eval.sets at least)")
    stop_event = stop_event or threading.Event()
    stats = deps.stats if deps.stats is not None else EvaluatorStats()
    reward = load_reward(ecfg.scoring_routes())
    extract = load_extractor(ecfg.extractor)
    sets = load_sets(ecfg, set_options(shared.data, engine_cfg.model_dir))
    transport = Transport(shared, "evaluator")
    transport.ensure_topics()
    topic = ensure_evals_topic(transport)
    engine = deps.engine if deps.engine is not None else build_engine(engine_cfg)
    token_ids = tokenize_sets(sets, engine, ecfg.max_new_tokens)
    done = read_done(transport, topic)
    stats.resumed = sorted(done)
    sink = transport.sink()
    ledger = Ledger(sink, topic, shared.run_dir)
    stats.rows_restored = ledger.sync_file(done)
    receiver = WeightsReceiver(transport, shared.weights)
    loop = _Loop(engine, receiver, ledger, ecfg, stats, set(done), deps.on_evaluation)
    telemetry = loop.telemetry = RoleTelemetry(shared, "evaluator", transport)  # heartbeats (stream-rl status)
    telemetry.set_ready(model_loaded=True, version=engine.version)
    loop.evaluator_id = ecfg.evaluator_id or transport.instance_id
    loop.work = (sets, token_ids, reward, extract)
    log.info("evaluator: %d set(s), versions done on the evals topic: %s", len(sets), stats.resumed or "none")
    try:
        while not stop_event.is_set() and (max_evaluations is None or len(stats.evaluated) < max_evaluations):
            telemetry.tick()
            loop.iterate()
    finally:
        for closable in (receiver, sink, telemetry):
            closable.close()
        if deps.engine is None:
            engine.close()
    return stats


class _Loop:
    """One iteration of the module docstring's loop."""

    def __init__(self, engine, receiver, ledger, ecfg, stats: EvaluatorStats, done: set[int], on_evaluation):
        self.engine, self.receiver, self.ledger, self.ecfg = engine, receiver, ledger, ecfg
        self.stats, self.done, self.on_evaluation = stats, done, on_evaluation
        self.seen: dict[int, object] = {}  # version -> its last manifest seen
        self.rejected: set[int] = set()
        self.evaluator_id, self.work = "evaluator", None
        self.telemetry = None  # RoleTelemetry: the heartbeat's version, step (= evaluations) and last metrics

    def iterate(self) -> None:
        from stream_rl.evaluation.schedule import plan_next

        wait = self.ecfg.poll_timeout_s
        self.receiver.poll_latest(wait, newer_than=max(self.seen, default=-1))  # wait for a newer version, then
        latest = self.receiver.poll_latest(wait)  # catch up with the topic's end: the newest due is the target
        if latest is not None:
            self.seen.update({m.version: m for m in self.receiver.candidates(-1)})  # the last manifest of each
        plan = plan_next(set(self.seen) - self.rejected, self.done, self.ecfg.every_versions, self.ecfg.before_train)
        if plan.target is None:
            return
        if plan.skipped:
            log.warning("evaluator: skipping versions %s (slower than the trainer); evaluating v%d", plan.skipped,
                        plan.target)
            self.stats.skipped += plan.skipped
            self.done.update(plan.skipped)  # passed over for good: plan_next never goes back below a done version
        manifest = self.seen.get(plan.target)
        if plan.target > 0 and not self._load(manifest):
            return
        self._evaluate(plan.target, 0 if manifest is None else manifest.step, plan.skipped)

    def _load(self, manifest) -> bool:
        from producers.weights_follower import ProducerStats, WeightsFollower

        if self.engine.version == manifest.version:
            return True
        if WeightsFollower(self.receiver, self.engine, ProducerStats()).load(manifest):
            return True
        self.rejected.add(manifest.version)
        self.stats.rejected_versions.append(manifest.version)
        return False

    def _evaluate(self, version: int, step: int, skipped: list[int]) -> None:
        sets, token_ids, reward, extract = self.work
        if version == 0 and self.engine.version != 0:
            log.warning("evaluator: the engine no longer holds version 0; v0 is not evaluated")
            self.done.add(0)
            return
        start = time.monotonic()
        metrics = evaluate_sets(self.engine, sets, token_ids, self.ecfg, reward, extract)
        msg = Evaluation(version=version, step=step, sets=[s.name for s in sets], metrics=metrics,
                         evaluator_id=self.evaluator_id, elapsed_s=time.monotonic() - start)
        self.ledger.record(msg, skipped)
        self.done.add(version)
        self.stats.evaluated.append(version)
        if self.telemetry is not None:
            self.telemetry.set_version(version)
            self.telemetry.set_step(len(self.stats.evaluated))
            self.telemetry.step_metrics = {"eval/version": float(version), "eval/step": float(step),
                                           **{f"eval/{k}": v for k, v in metrics.items()}}  # the heartbeat's
        log.info("evaluation v%d (step %d, %.1fs): %s", version, step, msg.elapsed_s,
                 {k: round(v, 4) for k, v in metrics.items() if k.count("/") == 1 or k.endswith("/greedy/accuracy")
                  and k.count("/") == 2})  # the set-level values, not each data source's
        if self.on_evaluation is not None:
            self.on_evaluation(msg)


def evaluate_once(shared: SharedConfig, ecfg: EvalConfig | None, engine_cfg: ProducerConfig,
                  engine=None) -> Evaluation:
    """Evaluate the weights of ``engine_cfg.model_dir`` (or ``engine``'s) once, with no broker: the Evaluation
    of version 0 at step 0 (``stream-rl evaluate --model / --checkpoint``). Arguments as :func:`run_evaluator`'s."""
    from producers.engines import build_engine
    from stream_rl.evaluation.scoring import load_extractor, load_reward

    if ecfg is None:
        raise ValueError("stream-rl evaluate needs an [eval] section (eval.sets at least)")
    reward = load_reward(ecfg.scoring_routes())
    extract = load_extractor(ecfg.extractor)
    sets = load_sets(ecfg, set_options(shared.data, engine_cfg.model_dir))
    own = engine is None
    engine = build_engine(engine_cfg) if own else engine
    try:
        start = time.monotonic()
        metrics = evaluate_sets(engine, sets, tokenize_sets(sets, engine, ecfg.max_new_tokens), ecfg, reward, extract)
    finally:
        if own:
            engine.close()
    return Evaluation(version=engine.version, step=0, sets=[s.name for s in sets], metrics=metrics,
                      evaluator_id=ecfg.evaluator_id or "evaluate-once", elapsed_s=time.monotonic() - start)
