"""The trainer's progress records: checkpoints and the consumer group's committed offsets.

Consumes: the trainer's :class:`~consumers.trainer.train_step.TrainState` and
:class:`~consumers.trainer.batcher.Batcher` (its safe offsets and dedup ledger), the engine whose weights a
checkpoint saves, the start positions of every assigned partition (:mod:`~consumers.trainer.positions`), the sink
whose sends must be on the broker first, the source that commits, and the ranks to keep in lockstep.
Produces: checkpoints in ``root`` (:func:`~stream_rl.storage.checkpoint.save_checkpoint`, pruned to
``trainer.keep_checkpoints``) and commits of the same safe offsets to the trainer's consumer group;
``last_checkpoint_step`` and ``checkpoint_s`` (the duration of the checkpoint written since the last metrics row).

Guarantees:
- Safe offsets are recorded (checkpointed or committed) only after ``sink.flush()``, so every stale record,
  re-queued prompt and dead letter below them is on the broker.
- A checkpoint commits the offsets it saved, after it is complete (the failpoint ``trainer.after_checkpoint`` sits
  between the two); only offsets of assigned partitions are committed.
- The other ranks are sent SAVE before a checkpoint and WEIGHTS before the finite check of a stop alert.
- After a ``stop`` alert a checkpoint is written only if the weights are finite: a NaN step never becomes the
  newest checkpoint a ``--resume`` would load.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from consumers.trainer.batcher import Batcher
from consumers.trainer.config import TrainerConfig
from consumers.trainer.ranks import Command, Ranks
from consumers.trainer.train_step import TrainState
from stream_rl.runtime import failpoints
from stream_rl.storage.checkpoint import prune_checkpoints, save_checkpoint

if TYPE_CHECKING:
    from consumers.trainer.engines import TrainEngine
    from stream_rl.transport.edge import Source
    from stream_rl.transport.sink import Sink

log = logging.getLogger(__name__)


class Progress:
    """Checkpoints and commits of one trainer (see the module docstring)."""

    def __init__(self, root: Path, tcfg: TrainerConfig, state: TrainState, batcher: Batcher, engine: TrainEngine,
                 ranks: Ranks, source: Source, sink: Sink, start: dict[tuple[str, int], int]):
        self.root, self.tcfg, self.state, self.batcher, self.engine = root, tcfg, state, batcher, engine
        self.ranks, self.source, self.sink, self.start = ranks, source, sink, start
        self.last_checkpoint_step = state.step
        self.checkpoint_s = 0.0  # duration of the checkpoint written since the last metrics row

    def checkpoint_if_due(self) -> None:
        """Every ``checkpoint_every`` steps a checkpoint; its duration goes on the next metrics row."""
        self.checkpoint_s = 0.0
        if self.state.step % self.tcfg.checkpoint_every == 0:
            t0 = time.monotonic()
            self.checkpoint()
            self.checkpoint_s = time.monotonic() - t0

    def checkpoint(self) -> Path:
        """Flush, checkpoint atomically, prune, then commit the same safe offsets to the consumer group."""
        self.sink.flush()
        offsets = {**self.start, **self.batcher.safe_offsets()}
        self.ranks.send(Command.SAVE)
        path = save_checkpoint(self.root, step=self.state.step, version=self.state.version, engine=self.engine,
                               offsets=offsets, ledger=self.batcher.ledger_state(), state=self.state.to_json())
        prune_checkpoints(self.root, self.tcfg.keep_checkpoints)
        self.last_checkpoint_step = self.state.step
        failpoints.hit("trainer.after_checkpoint")  # recovery drills: a checkpoint whose offsets are not committed
        self._commit(offsets)
        log.info("checkpoint %s (version %d)", path, self.state.version)
        return path

    def commit_progress(self) -> None:
        """A step without a checkpoint: flush, then commit the safe offsets (module docstring)."""
        if self.sink.pending:
            self.sink.flush()
        self._commit({**self.start, **self.batcher.safe_offsets()})

    def _commit(self, offsets: dict[tuple[str, int], int]) -> None:
        assigned = self.source.assignment()
        commit = {k: off for k, off in offsets.items() if k in assigned}
        if commit:
            self.source.commit(commit)

    def checkpoint_after_stop(self) -> None:
        """A ``stop`` alert: checkpoint the progress unless the weights are no longer finite (a NaN step must not
        become the newest checkpoint a ``--resume`` would load; the last periodic checkpoint stays the newest)."""
        if self.state.step <= self.last_checkpoint_step:
            return
        self.ranks.send(Command.WEIGHTS)
        if all(bool(torch.isfinite(t).all()) for t in self.engine.policy_state_dict().values()):
            self.checkpoint()
        else:
            log.error("stop alert: weights are not finite after step %d, no final checkpoint (newest stays step %d)",
                      self.state.step, self.last_checkpoint_step)
