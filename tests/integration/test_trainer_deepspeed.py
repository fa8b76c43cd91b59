"""DeepSpeed ZeRO on CPU (one process, gloo) against the plain torch engine: same step, same guard, same checkpoint.

Run where deepspeed is installed, e.g. ``PYTHONPATH=. /tmp/venvtest/bin/python -m pytest
tests/integration/test_trainer_deepspeed.py``. The first DeepSpeed start in a fresh environment JIT-compiles a shared-memory
communication op (minutes on 2 busy cores; cached in ~/.cache/torch_extensions afterwards).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed", reason="deepspeed is not installed in this environment (optional extra "
                                        "'deepspeed'); the torch engine is tested without it")

from support.trainer import random_group, tiny_policy, trainer_cfg

from consumers.trainer.deepspeed_engine import DeepSpeedEngine  # noqa: E402
from consumers.trainer.engines import TorchEngine, TrainModule  # noqa: E402
from consumers.trainer.tensors import build_batch  # noqa: E402
from consumers.trainer.train_step import TrainState, train_step  # noqa: E402
from stream_rl.storage.checkpoint import latest_checkpoint, save_checkpoint  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


def make_batch(seed: int = 0):
    model = tiny_policy(seed=0)
    rng = np.random.default_rng(seed)
    return build_batch([s for p in range(2) for s in random_group(model, p, group_size=2, rng=rng,
                                                                    rewards=[1.0, 0.0])])


def engines(cfg):
    return (TorchEngine(TrainModule(tiny_policy(seed=0)), cfg),
            DeepSpeedEngine(TrainModule(tiny_policy(seed=0)), cfg.model_copy(update={"engine": "deepspeed"})))


def assert_same_weights(a, b, atol=1e-6):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k], sb[k], rtol=1e-5, atol=atol), k


@pytest.mark.parametrize("stage", [2, 1, 3])
def test_zero_steps_equal_torch_steps_and_share_the_nan_guard(stage):
    cfg = trainer_cfg(zero_stage=stage, micro_batch_size=2, grad_clip=0.5, lr=1e-2, weight_decay=0.01)
    torch_engine, ds_engine = engines(cfg)
    before = {k: v.clone() for k, v in ds_engine.state_dict().items()}
    # ZeRO-3 reduce-scatters gradients in another summation order; Adam's first steps turn rounding-level
    # differences of near-zero gradients into ~lr * 1e-4 weight differences, hence its looser tolerance
    atol = 1e-5 if stage == 3 else 1e-6
    ts, ds = TrainState(), TrainState()
    for seed in (0, 1):  # two steps: the second one uses the Adam moments of the first
        batch = make_batch(seed)
        mt = train_step(torch_engine, batch, cfg, ts)
        md = train_step(ds_engine, batch, cfg, ds)
        assert md["optim/updates"] == 1.0
        assert md["optim/grad_norm"] == pytest.approx(mt["optim/grad_norm"], rel=1e-4)
        assert md["loss/total"] == pytest.approx(mt["loss/total"], rel=1e-4, abs=1e-6)
    assert_same_weights(torch_engine, ds_engine, atol)
    assert not torch.allclose(before["policy.lm_head.weight"], ds_engine.state_dict()["policy.lm_head.weight"])
    # NaN reward: both skip, weights untouched; the next clean step still matches (ZeRO buffers were cleared)
    bad = make_batch(2)
    bad.rewards[1] = float("nan")
    snapshot = {k: v.clone() for k, v in ds_engine.state_dict().items()}
    md = train_step(ds_engine, bad, cfg, ds)
    train_step(torch_engine, bad, cfg, ts)
    assert md["optim/skipped_updates"] == 1.0 and ds.skipped_updates == 1
    assert all(torch.equal(snapshot[k], v) for k, v in ds_engine.state_dict().items())
    batch = make_batch(3)
    train_step(torch_engine, batch, cfg, ts)
    train_step(ds_engine, batch, cfg, ds)
    assert_same_weights(torch_engine, ds_engine, atol)


def test_a_deepspeed_checkpoint_loads_into_either_engine(tmp_path):
    cfg = trainer_cfg(zero_stage=2, micro_batch_size=4, lr=1e-2)
    torch_engine, ds_engine = engines(cfg)
    batch = make_batch(0)
    train_step(ds_engine, batch, cfg, TrainState())
    save_checkpoint(tmp_path, step=1, version=1, engine=ds_engine, offsets={}, ledger={}, state={})
    path = latest_checkpoint(tmp_path)
    torch_engine.load(path)
    ds_fresh = DeepSpeedEngine(TrainModule(tiny_policy(seed=4)), cfg.model_copy(update={"engine": "deepspeed"}))
    ds_fresh.load(path)
    (t0, m0), (t1, m1) = ds_engine.optimizer_state(), torch_engine.optimizer_state()
    assert t0.keys() == t1.keys() and all(torch.allclose(t0[k], t1[k]) for k in t0)
    assert m0["scalars"] == m1["scalars"]
    for engine in (ds_engine, torch_engine, ds_fresh):
        train_step(engine, make_batch(1), cfg, TrainState(step=1))
    assert_same_weights(ds_engine, torch_engine)
    assert_same_weights(ds_engine, ds_fresh)


def test_zero2_in_bf16_mixed_precision_equals_the_torch_engine_in_bf16():
    """Both engines autocast the forward to bf16 around fp32 master weights: the same step, within bf16 rounding
    of the summation order (the ZeRO tolerance above), and the DeepSpeed weights stay fp32."""
    cfg = trainer_cfg(zero_stage=2, micro_batch_size=2, lr=1e-2, dtype="bfloat16")
    torch_engine, ds_engine = engines(cfg)
    batch = make_batch(0)
    mt = train_step(torch_engine, batch, cfg, TrainState())
    md = train_step(ds_engine, batch, cfg, TrainState())
    assert md["optim/updates"] == 1.0
    assert md["optim/grad_norm"] == pytest.approx(mt["optim/grad_norm"], rel=1e-3)
    assert ds_engine.forward(batch)[0].dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for v in ds_engine.state_dict().values())
    assert_same_weights(torch_engine, ds_engine, atol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_with_shared_prompts_trains_as_the_plain_torch_step(stage):
    """trainer.share_prompts under ZeRO (stage 3 gathers the parameters in each of the two forwards of a micro
    batch): the same step as the torch engine running every row's prompt."""
    cfg = trainer_cfg(zero_stage=stage, micro_batch_size=2, lr=1e-2)
    torch_engine = TorchEngine(TrainModule(tiny_policy(seed=0)), cfg)
    ds_engine = DeepSpeedEngine(TrainModule(tiny_policy(seed=0), share_prompts=True),
                                cfg.model_copy(update={"engine": "deepspeed", "share_prompts": True}))
    batch = make_batch(0)
    mt = train_step(torch_engine, batch, cfg, TrainState())
    md = train_step(ds_engine, batch, cfg, TrainState())
    assert md["optim/updates"] == 1.0
    assert md["optim/grad_norm"] == pytest.approx(mt["optim/grad_norm"], rel=1e-4)
    assert md["loss/total"] == pytest.approx(mt["loss/total"], rel=1e-4, abs=1e-6)
    assert_same_weights(torch_engine, ds_engine, atol=1e-5)
