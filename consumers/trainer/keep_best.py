"""The trainer's hook for ``trainer.keep_best``: save the weights of each version the evaluator will judge, and
judge the evaluations as they arrive (:class:`stream_rl.evaluation.best.BestKeeper` does the bookkeeping).

Consumes: the trainer's section (``trainer.keep_best``, ``keep_best_mode``, ``keep_best_pending``), the
:class:`~stream_rl.config.shared.Agreements` (``eval``'s ``every_versions`` and ``before_train``, handed over by the
CLI, say which versions will be evaluated), the trainer's engine and ranks, and the run's evals topic (read by
:class:`stream_rl.evaluation.feed.EvalsFeed`: the trainer and the evaluator share a broker, not a disk).
Produces: ``{checkpoint_dir}/eval-pending/v{N:08d}/`` candidates and ``{checkpoint_dir}/best/`` (module docstring
of :mod:`stream_rl.evaluation.best`); the candidate's ``model.safetensors`` is the engine's full ``state_dict``
(fp32 master weights, the value head included) as a ``step-*`` checkpoint holds it, with ``lora.json`` for LoRA,
so ``stream-rl export --checkpoint {checkpoint_dir}/best`` exports the best version.
Guarantees: the weights are gathered only for a due version (every rank joins the gather, as for a broadcast);
judging reads only the evaluations published since the last step, never blocks on the evaluator, and
an evaluation that arrives after the trainer exits is judged at the trainer's next start (``--resume``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pathlib import Path

from consumers.trainer.engines import LORA_META, MODEL_FILE
from consumers.trainer.ranks import Command, Ranks
from stream_rl.config.shared import Agreements
from stream_rl.evaluation.best import BestKeeper, Judgement, is_due
from stream_rl.evaluation.feed import EvalsFeed
from stream_rl.storage.checkpoint import write_json, write_tensors

if TYPE_CHECKING:
    from consumers.trainer.engines import TrainEngine


class KeepBest:
    """``hold`` after each broadcast, ``poll`` after each step (both no-ops without ``trainer.keep_best``)."""

    def __init__(self, keeper: BestKeeper | None, engine: TrainEngine, ranks: Ranks):
        self.keeper, self.engine, self.ranks = keeper, engine, ranks

    @classmethod
    def open(cls, tcfg, agreements: Agreements, transport, root: Path, engine: TrainEngine, ranks: Ranks) -> KeepBest:
        """No keeper without ``tcfg.keep_best``; else one over ``root`` judging the evaluations on ``transport``'s
        evals topic."""
        keeper = None if tcfg.keep_best is None else BestKeeper(
            root, EvalsFeed.open(transport), tcfg.keep_best, tcfg.keep_best_mode, agreements.eval_every_versions,
            agreements.eval_before_train, tcfg.keep_best_pending)
        return cls(keeper, engine, ranks)

    def hold(self, version: int, step: int) -> Path | None:
        """Save the weights of ``version`` (just published) when the evaluator will evaluate it."""
        keeper = self.keeper
        if keeper is None or not is_due(version, keeper.every, keeper.before_train):
            return None
        self.ranks.send(Command.WEIGHTS)  # the other ranks join the gather of the full weights
        weights = self.engine.state_dict()

        def write(directory: Path) -> None:
            write_tensors(directory / MODEL_FILE, weights)
            if self.engine.lora:
                write_json(directory / LORA_META, self.engine.lora_settings)

        return keeper.hold(version, step, write)

    def poll(self) -> list[Judgement]:
        return [] if self.keeper is None else self.keeper.poll()

    def close(self) -> None:
        """Close the evals feed's reader."""
        if self.keeper is not None:
            self.keeper.feed.close()
