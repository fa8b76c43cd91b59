"""The trainer's policy versions on the weights topics: publish, broadcast, reconcile on resume.

Consumes: the engine's policy weights (gathered from every rank first: ``Command.WEIGHTS``), the
:class:`~consumers.trainer.train_step.TrainState` (step, version, lineage), ``cfg.weights`` and, on resume, the newest
manifest on the broker (:class:`~stream_rl.weights.WeightsReceiver`).
Produces: policy versions through :class:`~stream_rl.weights.WeightsPublisher`: floating tensors in
``producer.dtype`` (the dtype the generators run); with ``trainer.lora`` the adapters only, stamped with
(rank, alpha). Every ``weights.keep_last`` versions a broadcast collects the older ones.
Guarantees:
- Versions never go backwards or repeat with different weights: on resume the newest published manifest is read;
  if it is newer than the checkpoint (weights published after the last checkpoint were lost), the checkpoint's
  weights are republished as the next version (``state.lineage`` records the jump, so staleness is measured
  through the checkpoint's version), and if the checkpoint's version was never published it is.
"""

from __future__ import annotations

import logging

from consumers.trainer.engines import cast_floating
from consumers.trainer.ranks import Command, Ranks
from consumers.trainer.train_step import TrainState
from schemas import WeightsManifest

log = logging.getLogger(__name__)


class PolicyVersions:
    """Publishes the trainer's policy (see the module docstring)."""

    def __init__(self, cfg, transport, sink, engine, ranks: Ranks):
        from stream_rl.weights import WeightsPublisher

        self.cfg, self.transport, self.engine, self.ranks = cfg, transport, engine, ranks
        self.publisher = WeightsPublisher(transport, sink, cfg.weights, transport.instance_id)

    def publish(self, state: TrainState) -> WeightsManifest:
        """Publish the policy as ``state.version``, in the dtype the generators run (``producer.dtype``)."""
        self.ranks.send(Command.WEIGHTS)
        weights = cast_floating(self.engine.policy_state_dict(), self.cfg.producer.dtype)
        lora = self.cfg.trainer.lora  # a LoRA version carries the adapters only, stamped with (rank, alpha)
        adapter = (lora.rank, lora.alpha) if lora.enabled else None
        return self.publisher.publish(weights, state.version, state.step, adapter=adapter)

    def broadcast(self, state: TrainState) -> int:
        """Publish ``state.version`` (just advanced) and, every ``keep_last`` versions, collect the older ones;
        returns the bytes sent."""
        sent = self.publish(state).sent_bytes
        keep = self.cfg.weights.keep_last
        if state.version % keep == 0:  # GC lists topics: not every version
            self.publisher.collect_garbage(keep)
        return sent

    def reconcile(self, state: TrainState) -> None:
        """On resume: continue the numbering after the newest published version (module docstring)."""
        from stream_rl.weights import WeightsReceiver

        receiver = WeightsReceiver(self.transport, self.cfg.weights)
        try:
            latest = receiver.poll_latest(timeout_s=10.0)
        finally:
            receiver.close()
        published = latest.version if latest is not None else -1
        if published == state.version:
            return
        if published > state.version:
            log.warning("versions up to %d were published after the checkpoint (version %d); republishing the "
                        "checkpoint's weights as version %d (staleness is measured through the checkpoint's "
                        "version, so the backlog stays as fresh as it was)", published, state.version,
                        published + 1)
            state.lineage.append([state.version, published + 1])
            state.version = published + 1
        self.publish(state)
