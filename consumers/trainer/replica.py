"""What every trainer rank holds (the restored model and engine), and the loop of the ranks that follow the leader.

Consumes: the shared config and the trainer's section, this process's :class:`~consumers.trainer.ranks.Ranks`,
and with ``resume`` the newest complete checkpoint under the trainer's checkpoint directory.
Produces: :class:`Replica` (engine, pad id, the checkpoint it resumed from) for the leader and for every follower;
:func:`run_follower`, the loop of a rank > 0; :func:`step_payload` / :func:`read_step`, the leader's STEP message.
Guarantees:
- Every rank restores the same weights and optimizer state: each reads the one consolidated checkpoint (ZeRO cuts
  its partitions from the full tensors on load), so ``--resume`` works with any number of ranks.
- A follower touches no Kafka and writes no file. It answers the leader's commands in order: STEP trains its share
  of the batch the leader sends (the same scored rollouts, the same state), WEIGHTS and SAVE join the collectives
  that gather the full weights (and optimizer state), STOP ends it with exit code 0. SIGTERM does not stop a
  follower (the leader decides when the group stops, after its step and checkpoint); a leader that is gone makes
  the follower's next collective raise :class:`~consumers.trainer.ranks.RankFailure` within the timeout.
- The STEP payload is msgpack: the state as JSON-like values and each rollout as its wire record value
  (``schemas.encode``), so followers validate what they train on exactly as the leader's consumer did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import logging
from dataclasses import dataclass
from pathlib import Path

import msgpack

from consumers.trainer.config import TrainerConfig
from consumers.trainer.engines import MODEL_FILE, OPTIMIZER_FILE, OPTIMIZER_META, TrainModule, build_engine
from consumers.trainer.ranks import Command, Ranks
from consumers.trainer.tensors import build_batch
from consumers.trainer.train_step import TrainState, train_step
from schemas import ScoredRollout, decode, encode
from stream_rl.config.shared import SharedConfig, checkpoint_root
from stream_rl.storage.checkpoint import Checkpoint, latest_checkpoint, load_checkpoint, read_json, read_tensors

if TYPE_CHECKING:
    from consumers.trainer.engines import TrainEngine

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """The model side of one rank: its engine, the tokenizer's pad id, and the checkpoint it resumed from."""

    engine: TrainEngine
    pad_id: int
    checkpoint: Checkpoint | None
    path: Path | None


def restore(cfg: SharedConfig, tcfg: TrainerConfig, ranks: Ranks, resume: bool) -> Replica:
    """Load the initial policy (or, with ``resume``, the newest checkpoint's weights, optimizer state and RNG);
    ``cfg``: the shared sections (``run_dir``), ``tcfg``: the trainer's section."""
    from consumers.trainer.lora import load_module_state, wrap_policy
    from stream_rl.models import load_policy

    if tcfg.model_dir is None:
        raise ValueError("trainer.model_dir is not set: the trainer needs the initial policy's directory")
    policy, tokenizer = load_policy(tcfg.model_dir)
    if tcfg.lora.enabled:  # adapters on the frozen base (consumers.trainer.lora)
        policy = wrap_policy(policy, tcfg.lora)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    module = TrainModule(policy, value_head=tcfg.advantage == "gae", share_prompts=tcfg.share_prompts,
                         packing=tcfg.packing, pack_length=tcfg.pack_length,
                         gradient_checkpointing=tcfg.gradient_checkpointing)
    path = latest_checkpoint(checkpoint_root(cfg.run_dir, tcfg.checkpoint_dir)) if resume else None
    ckpt = load_checkpoint(path) if path is not None else None
    if ckpt is not None and path is not None:
        load_module_state(module, read_tensors(path / MODEL_FILE), tcfg.lora.enabled)
    engine = build_engine(module, tcfg, ranks)
    if ckpt is not None and path is not None:
        engine.load_optimizer_state(read_tensors(path / OPTIMIZER_FILE), read_json(path / OPTIMIZER_META))
        ckpt.restore_rng()
    return Replica(engine, pad_id, ckpt, path)


def step_payload(state: TrainState, scored: list[ScoredRollout]) -> bytes:
    """The leader's STEP message: the state before the step and the batch's scored rollouts."""
    return msgpack.packb({"state": state.to_json(), "records": [encode(s) for s in scored]}, use_bin_type=True)


def read_step(payload: bytes) -> tuple[TrainState, list[ScoredRollout]]:
    data = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    return TrainState.from_json(data["state"]), [cast(ScoredRollout, decode(r, "scored_rollout"))
                                                 for r in data["records"]]


def run_follower(cfg: SharedConfig, tcfg: TrainerConfig, ranks: Ranks, resume: bool) -> None:
    """Rank > 0: mirror the leader's engine calls until it says STOP (module docstring)."""
    replica = restore(cfg, tcfg, ranks, resume)
    engine, steps, stopped = replica.engine, 0, False
    log.info("rank %d follows the leader (%s)", ranks.rank,
             f"resumed from {replica.path}" if replica.path else "initial weights")
    try:
        while True:
            command, payload = ranks.receive()
            if command is Command.STEP:
                state, scored = read_step(payload)
                train_step(engine, build_batch(scored, replica.pad_id), tcfg, state)
                steps += 1
            elif command is Command.WEIGHTS:
                engine.policy_state_dict()
            elif command is Command.SAVE:
                engine.full_state()
            elif command is Command.STOP:
                log.info("rank %d: stop after %d steps", ranks.rank, steps)
                stopped = True
                return
    finally:
        ranks.close(together=stopped)
