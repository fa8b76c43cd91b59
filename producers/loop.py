"""``stream-rl produce``: the thin Kafka loop around the producer step.

Consumes: ``Prompt`` records from the run's prompts topic, in the consumer group ``{prefix}.{run}.producers``
(so producer processes share the prompts), and weights manifests/payloads through
:class:`~stream_rl.weights.receiver.WeightsReceiver`.
Produces: ``Rollout`` records on the rollouts topic keyed by ``group_id`` (a group stays on one partition);
prompts that cannot be generated for go to the dead-letter topic with the reason.

One batch::

    [between batches] newer manifest? ─ yes ─> fetch + verify ─> engine.load_weights ─> version v'
                                                   └─ WeightsError / WeightsMismatch: log, keep version v
    poll <= prompts_per_batch prompts ─> produce_rollouts (pure) ─> send rollouts ─> flush (acks) ─> commit

Backpressure: with ``producer.max_groups_per_version`` set (this producer's share of the groups the trainer
consumes per version), a producer that has generated its share for ``versions_ahead`` versions beyond the weights
it holds waits for a newer version before taking more prompts. Generation then overlaps training, and rollouts
stay about ``versions_ahead`` versions old instead of piling up until they are dropped as stale.

Guarantees:
- Offsets are committed only after every rollout (and dead letter) of the batch was acknowledged by the broker:
  a crash before the commit regenerates the batch (same rollout ids; consumers drop duplicates by id), a restart
  after it reads no prompt twice.
- Weights change only between batches, after the whole version was fetched and verified; a version that fails
  verification or does not fit the model is logged and skipped (the same manifest is not retried; a version
  re-published with another payload is), and generation continues on the previous version. At start-up the
  producer first catches up with the newest complete version.
- Processing runs inside ``source.process_span("generate", batch)``, so rollouts carry the prompts' trace context.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

from producers.config import ProducerConfig
from producers.engines.base import GenerationEngine, WeightsMismatch
from producers.step import StepResult, produce_rollouts

log = logging.getLogger(__name__)


@dataclass
class ProducerStats:
    """What one ``run_producer`` call did (for tests, logs and the CLI's exit summary)."""

    batches: int = 0
    prompts: int = 0
    rollouts: int = 0
    rejected_prompts: int = 0
    weight_updates: list[int] = field(default_factory=list)
    rejected_versions: list[int] = field(default_factory=list)
    version: int = 0
    groups: int = 0
    start_version: int = 0


class _WeightsFollower:
    """Moves the engine to the newest verified weights version; remembers versions it rejected."""

    def __init__(self, receiver, engine: GenerationEngine, stats: ProducerStats):
        self.receiver = receiver
        self.engine = engine
        self.stats = stats
        self._rejected: set[tuple[int, str]] = set()  # (version, sha256): a re-published fix is tried again
        self.newest_seen = -1  # newest manifest version seen (staleness of the weights this producer holds)

    def update(self, timeout_s: float = 0.0, wait_for_newer: bool = False) -> None:
        """Load the newest verified version; with ``wait_for_newer``, wait up to ``timeout_s`` for one."""
        from stream_rl.weights.receiver import WeightsError

        manifest = self.receiver.poll_latest(timeout_s, newer_than=self.engine.version if wait_for_newer else None)
        if manifest is not None:
            self.newest_seen = max(self.newest_seen, manifest.version)
        if (manifest is None or manifest.version <= self.engine.version
                or (manifest.version, manifest.sha256) in self._rejected):
            return
        old = self.engine.version
        try:
            tensors = self.receiver.fetch(manifest)
            self.engine.load_weights(tensors, manifest.version)
        except (WeightsError, WeightsMismatch) as exc:
            self._rejected.add((manifest.version, manifest.sha256))
            self.stats.rejected_versions.append(manifest.version)
            log.error("rejected weights v%d, still generating with v%d: %s", manifest.version, old, exc)
            return
        self.stats.weight_updates.append(manifest.version)
        log.info("weights v%d -> v%d (step %d)", old, manifest.version, manifest.step)


def run_producer(cfg, stop_event: threading.Event | None = None, max_batches: int | None = None, *,
                 producer_cfg: ProducerConfig | None = None, weights_cfg=None,
                 engine: GenerationEngine | None = None, stats: ProducerStats | None = None) -> ProducerStats:
    """Generate rollouts for prompts until ``stop_event`` is set or ``max_batches`` batches were produced.

    ``cfg`` is the root config; ``producer_cfg`` and ``weights_cfg`` default to ``cfg.producer`` and
    ``cfg.weights``. ``engine`` replaces the one built from ``producer_cfg`` (tests reuse a loaded engine); an
    engine built here is closed on return. ``stats`` is updated live (progress display) and returned.
    """
    from producers.engines import build_engine
    from stream_rl.telemetry.role import RoleTelemetry
    from stream_rl.transport.client import Transport

    pcfg = producer_cfg if producer_cfg is not None else cfg.producer
    stop_event = stop_event or threading.Event()
    transport = Transport(cfg, "producer")
    transport.ensure_topics()
    producer_id = pcfg.producer_id or transport.instance_id
    own_engine = engine is None
    engine = build_engine(pcfg) if own_engine else engine
    stats = stats if stats is not None else ProducerStats()
    stats.version = engine.version
    sink = transport.sink()
    group = transport.names.group("producers")
    source = transport.source([transport.names.prompts], group, "prompt", sink)
    follower = _follower(transport, weights_cfg if weights_cfg is not None else getattr(cfg, "weights", None),
                         pcfg, engine, stats)
    stats.start_version = engine.version  # after the start-up catch-up: the backpressure budget counts from here
    telemetry = RoleTelemetry(cfg, "producer", transport, group=group, topics=[transport.names.prompts])
    telemetry.attach(source, sink).set_ready(model_loaded=True, version=engine.version)
    try:
        while not stop_event.is_set() and (max_batches is None or stats.batches < max_batches):
            telemetry.tick()  # alerts: "stop" ends here, after the previous batch was committed
            telemetry.check_stop()
            source.paused = telemetry.paused
            if follower is not None and stats.batches % pcfg.weights_check_every_batches == 0:
                follower.update()
                telemetry.set_version(engine.version)
            if follower is not None and _over_budget(stats, engine, pcfg):
                follower.update(timeout_s=pcfg.poll_timeout_s, wait_for_newer=True)  # backpressure
                continue
            records = source.poll(pcfg.poll_timeout_s, max_records=pcfg.prompts_per_batch)
            if not records:
                sink.flush()  # dead letters of a batch with no valid prompt
                source.commit()
                continue
            with source.process_span("generate", records, {"stream_rl.producer_id": producer_id}):
                result = _generate(records, engine, pcfg, producer_id)
                _publish(result, records, source, sink, transport.names.rollouts)
            if not source.commit():
                log.warning("lost the prompts' partitions before committing: the batch will be regenerated")
                telemetry.error("CommitLost")
            _account(stats, result, engine)
            _observe(telemetry, result, follower, engine)
    except Exception as exc:
        telemetry.error(type(exc).__name__)
        raise
    finally:
        for closable in (telemetry, follower.receiver if follower else None, source, sink):
            if closable is not None:
                closable.close()
        if own_engine:
            engine.close()
    return stats


def _observe(telemetry, result: StepResult, follower: _WeightsFollower | None, engine: GenerationEngine) -> None:
    """Per batch: generated tokens, generation time, and how many versions the weights held are behind."""
    telemetry.tokens(int(result.metrics.get("producer/response_tokens", 0)))
    telemetry.observe_seconds("generate", float(result.metrics.get("producer/generate_s", 0.0)))
    telemetry.set_version(engine.version)
    if follower is not None and follower.newest_seen >= 0:
        telemetry.observe_staleness([max(0, follower.newest_seen - engine.version)])


def _follower(transport, weights_cfg, pcfg: ProducerConfig, engine: GenerationEngine,
              stats: ProducerStats) -> _WeightsFollower | None:
    if not pcfg.follow_weights:
        return None
    from stream_rl.weights.receiver import WeightsReceiver

    if weights_cfg is None:
        raise ValueError("producer.follow_weights needs the weights settings (cfg.weights or weights_cfg)")
    follower = _WeightsFollower(WeightsReceiver(transport, weights_cfg), engine, stats)
    follower.update(timeout_s=pcfg.weights_startup_wait_s)  # a late joiner starts from the newest version
    return follower


def _generate(records, engine: GenerationEngine, pcfg: ProducerConfig, producer_id: str) -> StepResult:
    return produce_rollouts([r.value for r in records], engine, producer_id=producer_id,
                            temperature=pcfg.temperature, max_new_tokens=pcfg.max_new_tokens, seed=pcfg.seed,
                            group_size=pcfg.group_size)


def _publish(result: StepResult, records, source, sink, topic: str) -> None:
    """Send the rollouts keyed by group and dead-letter rejected prompts; wait for the broker's acks."""
    for rollout in result.rollouts:
        sink.send(topic, rollout, key=rollout.group_id)
    for rejected in result.rejected:
        rec = records[rejected.index]
        source.dead_letter(rec.topic, rec.partition, rec.offset, rec.key, rec.raw_value, rejected.reason,
                           "PromptRejected")
    sink.flush()


def _over_budget(stats: ProducerStats, engine: GenerationEngine, pcfg: ProducerConfig) -> bool:
    """True when this producer is a full ``versions_ahead`` versions' share ahead of the weights it has.

    Since start-up at version ``v0`` it may generate ``(v - v0 + 1 + versions_ahead) * max_groups_per_version``
    groups by the time it holds version ``v``: with the share equal to the groups the trainer consumes per version,
    generation overlaps training while rollouts stay about ``versions_ahead`` versions behind the trainer.
    """
    share = pcfg.max_groups_per_version
    if share is None:
        return False
    allowed = (engine.version - stats.start_version + 1 + pcfg.versions_ahead) * share
    return stats.groups >= allowed


def _account(stats: ProducerStats, result: StepResult, engine: GenerationEngine) -> None:
    stats.groups += len({r.group_id for r in result.rollouts})
    stats.batches += 1
    stats.prompts += int(result.metrics.get("producer/prompts", 0))
    stats.rollouts += len(result.rollouts)
    stats.rejected_prompts += len(result.rejected)
    stats.version = engine.version
    log.info("producer batch %s", json.dumps({**result.metrics, "time": time.time()}, sort_keys=True))
