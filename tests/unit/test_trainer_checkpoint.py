"""Atomic, pickle-free checkpoints: exact round trip, incomplete directories ignored, pruning."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from support.trainer import random_group, tiny_policy, trainer_cfg

from consumers.trainer.batcher import Batcher
from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.tensors import build_batch
from consumers.trainer.train_step import TrainState, train_step
from stream_rl.storage.checkpoint import (
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)

torch.set_num_threads(1)
OFFSETS = {("stream-rl.t.scored", 0): 12, ("stream-rl.t.scored", 3): 7}


def trained_engine(seed: int = 0, advantage: str = "grpo"):
    cfg = trainer_cfg(advantage=advantage)
    model = tiny_policy(seed=seed)
    engine = TorchEngine(TrainModule(model, value_head=advantage == "gae"), cfg)
    items = [s for p in range(2) for s in random_group(model, p, rng=np.random.default_rng(0), rewards=[1, 0])]
    batch = build_batch(items)
    state = TrainState()
    train_step(engine, batch, cfg, state)
    state.kl_coef = 0.05  # a non-default value to round-trip
    return cfg, engine, batch, state


def draws():
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()


def ledger():
    b = Batcher(max_lag=1)
    b.ledger.add("p0", 0)
    b.requeued = {"p1:0": 2}
    return b.ledger_state()


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_round_trip_restores_weights_optimizer_rng_offsets_and_ledger(tmp_path, advantage):
    cfg, engine, batch, state = trained_engine(advantage=advantage)
    path = save_checkpoint(tmp_path, step=state.step, version=4, engine=engine, offsets=OFFSETS, ledger=ledger(),
                           state=state.to_json())
    assert path.name == checkpoint_name(1) == "step-00000001"
    assert sorted(p.suffix for p in path.iterdir()) == [".json"] * 3 + [".safetensors"] * 3  # no pickle
    expected = draws()
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    fresh = TorchEngine(TrainModule(tiny_policy(seed=7), value_head=advantage == "gae"), cfg)
    fresh.load(ckpt.path)
    ckpt.restore_rng()
    assert draws() == expected
    assert (ckpt.step, ckpt.version, ckpt.offsets, ckpt.ledger) == (1, 4, OFFSETS, ledger())
    assert TrainState.from_json(ckpt.state) == state
    a, b = engine.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (ta, ma), (tb, mb) = engine.optimizer_state(), fresh.optimizer_state()
    assert ma == mb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert any(k.endswith("::exp_avg_sq") for k in ta) and ma["scalars"]
    # the restored trainer takes exactly the same next step as the original
    for e in (engine, fresh):
        train_step(e, batch, cfg, TrainState(step=1))
    a, b = engine.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_incomplete_and_temporary_directories_are_ignored(tmp_path):
    cfg, engine, _, state = trained_engine()
    good = save_checkpoint(tmp_path, step=3, version=1, engine=engine, offsets={}, ledger={}, state={})
    (tmp_path / ".tmp-step-00000009-deadbeef").mkdir()
    (tmp_path / ".tmp-step-00000009-deadbeef" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "step-00000010").mkdir()  # no trainer.json: never completed
    (tmp_path / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == good
    assert latest_checkpoint(tmp_path / "missing") is None
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(tmp_path, step=3, version=1, engine=engine, offsets={}, ledger={}, state={})


def test_prune_keeps_the_newest_n_and_removes_leftovers(tmp_path):
    _, engine, _, _ = trained_engine()
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, step=step, version=step, engine=engine, offsets={}, ledger={}, state={})
    (tmp_path / ".tmp-step-00000009-deadbeef").mkdir()
    removed = prune_checkpoints(tmp_path, keep=2)
    assert len(removed) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000008"]
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, keep=0)


def test_optimizer_state_that_needs_pickle_is_refused(tmp_path):
    _, engine, _, _ = trained_engine()
    first = next(iter(engine.optimizer.state.values()))
    first["custom"] = {"not": "a tensor"}
    with pytest.raises(CheckpointError, match="without pickle"):
        save_checkpoint(tmp_path, step=1, version=0, engine=engine, offsets={}, ledger={}, state={})
    assert latest_checkpoint(tmp_path) is None and list(tmp_path.iterdir()) == []
