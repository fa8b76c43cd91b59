"""The planner's ZeRO memory model against a real DeepSpeed engine on one CPU rank (moved from the planner's unit tests:
it builds the engine, which takes about a minute the first time)."""

from __future__ import annotations

import pytest

from stream_rl.planner import memory as mem


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_measured_deepspeed_keeps_an_fp32_master_copy_of_an_fp32_module(stage):
    # the trainer's DeepSpeed engine (fp32 module, bf16 autocast) on one CPU rank: the ZeRO optimizer steps a
    # separate fp32 copy of the partition (here all P), which the planner counts as master_copy = 4P / N
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (optional extra 'deepspeed')")
    import torch
    from support.trainer import tiny_policy, trainer_cfg

    from consumers.trainer.deepspeed_engine import DeepSpeedEngine
    from consumers.trainer.engines import TrainModule

    cfg = trainer_cfg(zero_stage=stage).model_copy(update={"engine": "deepspeed", "dtype": "bfloat16"})
    engine = DeepSpeedEngine(TrainModule(tiny_policy(seed=0)), cfg)
    optimizer = engine.ds.optimizer
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    if stage < 3:
        masters, partitions = optimizer.single_partition_of_fp32_groups, optimizer.bit16_groups_flat
    else:
        masters, partitions = optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat
    assert {t.dtype for t in masters} == {t.dtype for t in partitions} == {torch.float32}
    assert all(m.untyped_storage().data_ptr() != q.untyped_storage().data_ptr() for m, q in zip(masters, partitions))
    copy_bytes = sum(m.numel() * m.element_size() for m in masters)
    assert copy_bytes == mem.zero_master_copy_bytes(params, stage) == 4 * params
