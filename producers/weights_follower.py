"""Following the weights topic: the producer's engine moves to the newest verified policy version.

Consumes: weights manifests and payloads through :class:`~stream_rl.weights.receiver.WeightsReceiver`
(``weights`` section), a :class:`~producers.engines.base.GenerationEngine`.
Produces: engine weight loads (full versions, or LoRA adapter versions merged onto the base), the
:class:`ProducerStats` counters of them, and the engine's hook between decode steps for in-flight updates.
Guarantees: a version is loaded only once fetched whole and verified; one that fails verification or does not fit
the model is remembered (by version and digest) and skipped, and the next newest version above the one held is
tried instead (a corrupt v3 leaves the producer on v2, not on v0); a version re-published with another payload is
tried again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from producers.config import ProducerConfig
from producers.engines.base import GenerationEngine, WeightsHook, WeightsMismatch

log = logging.getLogger("producers.role")


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
    groups_returned: int = 0  # groups the trainer dropped as stale, returned to the backpressure budget
    groups_inherited: int = 0  # groups found in flight at start-up, counted by the backpressure budget
    budget_resets: int = 0  # times the budget was re-derived after producer.backpressure_timeout_s
    inflight_updates: int = 0  # versions loaded between decode steps of a generation (producer.inflight_updates)
    partials_published: int = 0  # cut groups whose prefixes went to the partials topic (producer.partial_max_lag)
    partials_resumed: int = 0  # partial groups completed from their prefixes
    partials_stale: int = 0  # partial groups dropped as stale, their prompts regenerated from scratch


class WeightsFollower:
    """Moves the engine to the newest verified weights version; remembers versions it rejected.

    When the newest version fails verification (or does not fit the model) it falls back to the next newest one
    above the version it holds, and so on: a corrupt v3 leaves the producer on v2, not on v0."""

    def __init__(self, receiver, engine: GenerationEngine, stats: ProducerStats):
        self.receiver = receiver
        self.engine = engine
        self.stats = stats
        self._rejected: set[tuple[int, str]] = set()  # (version, sha256): a re-published fix is tried again
        self.newest_seen = -1  # newest manifest version seen (staleness of the weights this producer holds)
        self.held_step: int | None = None  # the trainer step of the version loaded last (the budget's clock)

    def update(self, timeout_s: float = 0.0, wait_for_newer: bool = False) -> None:
        """Load the newest verified version; with ``wait_for_newer``, wait up to ``timeout_s`` for a version above
        both the one held and every rejected one."""
        newest_rejected = max((v for v, _ in self._rejected), default=-1)
        newer_than = max(self.engine.version, newest_rejected) if wait_for_newer else None
        latest = self.receiver.poll_latest(timeout_s, newer_than=newer_than)
        if latest is not None:
            self.newest_seen = max(self.newest_seen, latest.version)
        rejected_now: list[int] = []
        for manifest in self.receiver.candidates(self.engine.version):
            if (manifest.version, manifest.sha256) in self._rejected:
                continue
            if rejected_now:
                log.warning("weights v%d rejected: falling back to v%d", rejected_now[-1], manifest.version)
            if self.load(manifest):
                return
            rejected_now.append(manifest.version)

    def load(self, manifest) -> bool:
        """Fetch, verify and load one version; False (logged, remembered) when it fails verification or fit."""
        from stream_rl.models.lora import lora_scale
        from stream_rl.weights.receiver import WeightsError

        old = self.engine.version
        try:
            tensors = self.receiver.fetch(manifest)
            if manifest.is_adapter:  # trainer.lora: merged into the base weights the engine keeps
                scale = lora_scale(manifest.adapter_rank, manifest.adapter_alpha)
                self.engine.load_adapter(tensors, scale, manifest.version)
            else:
                self.engine.load_weights(tensors, manifest.version)
        except (WeightsError, WeightsMismatch) as exc:
            self._rejected.add((manifest.version, manifest.sha256))
            self.stats.rejected_versions.append(manifest.version)
            log.error("rejected weights v%d (%s: %s); generating with v%d until a newer verified version loads",
                      manifest.version, type(exc).__name__, exc, old)
            return False
        self.stats.weight_updates.append(manifest.version)
        self.held_step = manifest.step
        log.info("weights v%d -> v%d (step %d)", old, manifest.version, manifest.step)
        return True


def make_follower(transport, weights_cfg, pcfg: ProducerConfig, engine: GenerationEngine,
              stats: ProducerStats) -> WeightsFollower | None:
    """The producer's follower (None without ``producer.follow_weights``), caught up with the newest complete
    version (a late joiner starts from it)."""
    if not pcfg.follow_weights:
        return None
    from stream_rl.weights.receiver import WeightsReceiver

    if weights_cfg is None:
        raise ValueError("producer.follow_weights needs the weights settings (cfg.weights)")
    follower = WeightsFollower(WeightsReceiver(transport, weights_cfg), engine, stats)
    follower.update(timeout_s=pcfg.weights_startup_wait_s)  # a late joiner starts from the newest version
    return follower


def inflight_hook(follower: WeightsFollower, engine: GenerationEngine, telemetry,
                   stats: ProducerStats) -> WeightsHook:
    """The engine's hook between decode steps: one non-blocking pass over the weights topic, then the newest
    verified version above the one held, loaded exactly as between batches (a manifest is published only after its
    whole payload, so the fetch reads a complete version; a corrupt or misfitting one is rejected and the engine
    keeps its weights). The fetch itself runs on the decode thread: the generation waits for it."""

    def hook() -> None:
        before = engine.version
        follower.update()
        if engine.version != before:
            stats.inflight_updates += 1
            telemetry.set_version(engine.version)

    return hook
