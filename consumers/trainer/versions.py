"""The trainer's policy versions on the weights topics: publish, broadcast, reconcile on resume.

Consumes: the engine's policy weights (gathered from every rank first: ``Command.WEIGHTS``), the
:class:`~consumers.trainer.train_step.TrainState` (step, version, lineage), the shared ``weights`` section, the
broadcast dtype (:class:`~stream_rl.config.shared.Agreements`) and, on resume, the newest manifest on the broker
(:class:`~stream_rl.weights.WeightsReceiver`).
Produces: policy versions through :class:`~stream_rl.weights.WeightsPublisher`: floating tensors in the
broadcast dtype (``producer.dtype``, the dtype the producers run); with ``trainer.lora`` the adapters only,
stamped with (rank, alpha). Every ``weights.keep_last`` versions a broadcast collects the older ones.
Guarantees:
- Versions never go backwards or repeat with different weights: on resume the newest published manifest is read;
  if it is newer than the checkpoint (weights published after the last checkpoint were lost), the checkpoint's
  weights are republished as the next version (``state.lineage`` records the jump, so staleness is measured
  through the checkpoint's version), and if the checkpoint's version was never published it is.
- A trainer started without ``--resume`` on a run whose weights topic already holds a version above its own
  raises :class:`ForeignRunError` (:func:`check_fresh`): another trainer wrote that run (a run name
  used twice), and training on would mix the two runs' data and versions; :func:`foreign_run` words the diagnosis
  and the three ways on, for rollouts ahead of the trainer too (:mod:`consumers.trainer.intake`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging

from consumers.trainer.engines import cast_floating
from consumers.trainer.ranks import Command, Ranks
from consumers.trainer.train_step import TrainState
from schemas import WeightsManifest

if TYPE_CHECKING:
    from consumers.trainer.engines import TrainEngine

log = logging.getLogger(__name__)


class ForeignRunError(RuntimeError):
    """Records on the run's topics that this trainer's line of versions cannot have produced (exit 2)."""


def foreign_run(run: str, what: str, own: int) -> ForeignRunError:
    """The error for ``what`` (a manifest or rollout, with its version) ahead of this trainer's version ``own``."""
    return ForeignRunError(
        f"{what} is ahead of this trainer's policy version {own}: another trainer wrote run {run} (a run name used "
        f"twice?). Continue that run with `stream-rl train --resume` (or `stream-rl run --resume --run {run}`), "
        f"choose another name with --run NAME, or delete its topics with `stream-rl topics delete --run {run}`")


def newest_manifest(transport, weights_cfg) -> WeightsManifest | None:
    """The newest manifest on the run's weights topic (None: none); reads up to the topic's end, at most 10 s."""
    from stream_rl.weights import WeightsReceiver

    receiver = WeightsReceiver(transport, weights_cfg)
    try:
        return receiver.poll_latest(timeout_s=10.0)
    finally:
        receiver.close()


def check_fresh(transport, weights_cfg, version: int) -> None:
    """A trainer started without ``--resume`` (at ``version``): refuse a run whose weights topic already holds a
    newer version (:class:`ForeignRunError`)."""
    latest = newest_manifest(transport, weights_cfg)
    if latest is not None and latest.version > version:
        raise foreign_run(transport.names.run, f"weights manifest v{latest.version} (trainer step {latest.step}) "
                          f"on {transport.names.weights}", version)


class PolicyVersions:
    """Publishes the trainer's policy (see the module docstring)."""

    def __init__(self, weights_cfg, lora, dtype: str, transport, sink, engine: TrainEngine, ranks: Ranks):
        """``weights_cfg``: the shared ``weights`` section; ``lora``: ``trainer.lora``; ``dtype``: the broadcast
        dtype (``Agreements.weights_dtype``)."""
        from stream_rl.weights import WeightsPublisher

        self.weights_cfg, self.lora, self.dtype = weights_cfg, lora, dtype
        self.transport, self.engine, self.ranks = transport, engine, ranks
        self.publisher = WeightsPublisher(transport, sink, weights_cfg, transport.instance_id)

    def publish(self, state: TrainState) -> WeightsManifest:
        """Publish the policy as ``state.version``, in the dtype the producers run (``self.dtype``)."""
        self.ranks.send(Command.WEIGHTS)
        weights = cast_floating(self.engine.policy_state_dict(), self.dtype)
        lora = self.lora  # a LoRA version carries the adapters only, stamped with (rank, alpha)
        adapter = (lora.rank, lora.alpha) if lora.enabled else None
        return self.publisher.publish(weights, state.version, state.step, adapter=adapter)

    def broadcast(self, state: TrainState) -> int:
        """Publish ``state.version`` (just advanced) and, every ``keep_last`` versions, collect the older ones;
        returns the bytes sent."""
        sent = self.publish(state).sent_bytes
        keep = self.weights_cfg.keep_last
        if state.version % keep == 0:  # GC lists topics: not every version
            self.publisher.collect_garbage(keep)
        return sent

    def _latest(self) -> WeightsManifest | None:
        return newest_manifest(self.transport, self.weights_cfg)

    def reconcile(self, state: TrainState) -> None:
        """On resume: continue the numbering after the newest published version (module docstring)."""
        latest = self._latest()
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
