"""trainer.packing under DeepSpeed ZeRO on one CPU rank (gloo) against the torch engine on padded rows. A real
DeepSpeed engine (its first start in a fresh environment builds a communication op: about a minute), so it sits in
the integration tier; the packing logic itself is tested in tests/unit/test_trainer_packing.py."""

from __future__ import annotations

import pytest
import torch
from support.trainer import random_batch, tiny_policy, trainer_cfg

from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.train_step import TrainState, train_step


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_with_packing_trains_as_the_padded_torch_step(stage):
    """trainer.packing under DeepSpeed ZeRO (stage 3 gathers the output embedding called outside the policy's
    forward): the same step as the torch engine on padded rows."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (optional extra 'deepspeed')")
    from consumers.trainer.deepspeed_engine import DeepSpeedEngine

    cfg = trainer_cfg(zero_stage=stage, micro_batch_size=2, lr=1e-2, share_prompts=False)
    batch = random_batch(tiny_policy(seed=0), groups=2, group_size=2, seed=0)
    torch_engine = TorchEngine(TrainModule(tiny_policy(seed=0)), cfg)
    ds_cfg = cfg.model_copy(update={"engine": "deepspeed", "packing": True})
    ds_engine = DeepSpeedEngine(TrainModule(tiny_policy(seed=0), packing=True), ds_cfg)
    mt = train_step(torch_engine, batch, cfg, TrainState())
    md = train_step(ds_engine, batch, ds_cfg, TrainState())
    assert md["optim/updates"] == 1.0
    assert md["optim/grad_norm"] == pytest.approx(mt["optim/grad_norm"], rel=1e-4)
    assert md["loss/total"] == pytest.approx(mt["loss/total"], rel=1e-4, abs=1e-6)
    # ZeRO-3's reduce-scatter and the packed rows each sum in another order (each alone moves a weight by up to
    # ~1e-5 here); a wrong gradient would move weights by ~lr = 1e-2 under Adam
    sa, sb = torch_engine.state_dict(), ds_engine.state_dict()
    assert sa.keys() == sb.keys() and all(torch.allclose(sa[k], sb[k], rtol=1e-5, atol=5e-5) for k in sa)
