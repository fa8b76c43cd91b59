"""LoRA (trainer.lora) in the trainer: config refusals, adapters-only training, checkpoints and resume, the
broadcast's tensors, and `stream-rl export`. Helpers shared with tests/integration/test_lora_versions.py (the wire and the
producers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("peft")

from support.lora import LORA, logits_of, lora_cfg, lora_engine, train_once
from support.trainer import random_group, tiny_policy, trainer_cfg

from consumers.trainer.config import LoraConfig, TrainerConfig  # noqa: E402
from consumers.trainer.engines import TorchEngine, TrainModule  # noqa: E402
from consumers.trainer.lora import is_lora, wrap_policy  # noqa: E402
from consumers.trainer.tensors import build_batch  # noqa: E402
from stream_rl.cli.config import StreamRLConfig  # noqa: E402
from stream_rl.models.lora import (
    adapter_pairs,  # noqa: E402
    lora_scale,
)
from stream_rl.storage.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402

torch.set_num_threads(1)














# -- config -----------------------------------------------------------------------------------------------------


def test_lora_is_off_by_default_and_bounded():
    assert TrainerConfig().lora.enabled is False
    assert lora_scale(LoraConfig(rank=4, alpha=8.0).rank, 8.0) == 2.0  # the one scale every engine applies
    for bad in ({"rank": 0}, {"alpha": 0.0}, {"dropout": 1.0}, {"target_modules": []}):
        with pytest.raises(ValueError):
            LoraConfig(**bad)


def test_lora_with_deepspeed_is_refused_naming_both_fields():
    with pytest.raises(ValueError, match=r"lora\.enabled=true with engine='deepspeed'"):
        TrainerConfig(engine="deepspeed", lora={"enabled": True})


def test_lora_is_accepted_with_both_producer_engines():
    for engine in ("hf", "vllm"):  # both apply adapter versions (load_adapter); vllm: tests/integration/test_vllm_engine.py
        cfg = StreamRLConfig(trainer={"lora": {"enabled": True}}, producer={"engine": engine})
        assert cfg.trainer.lora.enabled and cfg.producer.engine == engine


# -- trainer ----------------------------------------------------------------------------------------------------


def test_only_adapters_are_trainable_and_the_optimizer_holds_only_them():
    engine = lora_engine()
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    held = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in engine.module.parameters() if p.requires_grad}
    assert is_lora(engine.module) and engine.lora


def test_a_step_changes_the_adapters_and_leaves_the_base_untouched():
    cfg = lora_cfg()
    engine = lora_engine(cfg=cfg)
    frozen = {n: p.detach().clone() for n, p in engine.module.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    train_once(engine, cfg)
    after = dict(engine.module.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in frozen.items())
    assert any(not torch.equal(after[n], t) for n, t in before.items() if ".lora_B." in n)  # B moved from 0


@pytest.mark.parametrize("value_head", [False, True])
def test_checkpoint_holds_adapters_and_optimizer_state_and_resumes_exactly(tmp_path, value_head):
    cfg = lora_cfg(advantage="gae" if value_head else "grpo")
    engine = lora_engine(cfg=cfg, value_head=value_head)
    train_once(engine, cfg)
    path = save_checkpoint(tmp_path, step=1, version=1, engine=engine, offsets={}, ledger={}, state={})
    saved = engine.state_dict()
    assert set(saved) == {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert any(n.startswith("value_head.") for n in saved) == value_head
    fresh = lora_engine(seed=0, cfg=cfg, value_head=value_head)  # same base, fresh adapters
    fresh.load(load_checkpoint(path).path)
    assert all(torch.equal(fresh.state_dict()[n], t) for n, t in saved.items())
    tensors, meta = engine.optimizer_state()
    fresh_tensors, fresh_meta = fresh.optimizer_state()
    assert set(tensors) == set(fresh_tensors) and all(torch.equal(tensors[k], fresh_tensors[k]) for k in tensors)
    assert meta == fresh_meta
    train_once(engine, cfg, seed=1)  # the next step is the same on both
    train_once(fresh, cfg, seed=1)
    assert all(torch.equal(fresh.state_dict()[n], t) for n, t in engine.state_dict().items())


def test_adapter_tensors_of_another_shape_are_refused():
    engine = lora_engine()
    other = lora_engine(cfg=trainer_cfg(lora={**LORA, "rank": 2}))
    with pytest.raises(CheckpointError, match="wrong shape"):
        engine.load_state_dict(other.state_dict())


def test_broadcast_carries_the_adapters_under_wire_names():
    engine = lora_engine()
    state = engine.policy_state_dict()
    names = sorted(state)
    assert names[0] == "model.layers.0.mlp.up_proj.lora_A.weight"
    assert len(names) == 2 * 3 * 2  # 2 layers x 3 target modules x (A, B)
    assert set(adapter_pairs(state)) == {f"model.layers.{i}.{m}" for i in range(2)
                                         for m in ("mlp.up_proj", "self_attn.q_proj", "self_attn.v_proj")}


def test_the_trainer_restores_a_lora_run_from_its_checkpoint(tmp_path):
    from consumers.trainer.ranks import SOLO
    from consumers.trainer.replica import restore
    from stream_rl.config.shared import checkpoint_root
    from stream_rl.demo.tokenizer import build_tokenizer

    base_dir = tmp_path / "base"
    tiny_policy(seed=0).save_pretrained(base_dir)
    build_tokenizer().save_pretrained(base_dir)
    cfg = StreamRLConfig(run_dir=tmp_path / "run", trainer={
        "model_dir": base_dir, "lora": LORA, "groups_per_step": 2, "micro_batch_size": 4, "lr": 1e-2,
        "grad_clip": None})
    first = restore(cfg, cfg.trainer, SOLO, resume=False).engine
    assert first.lora and set(first.state_dict()) == {n for n, p in first.module.named_parameters()
                                                      if p.requires_grad}
    train_once(first, cfg.trainer)
    save_checkpoint(checkpoint_root(cfg.run_dir, cfg.trainer.checkpoint_dir), step=1, version=1, engine=first,
                    offsets={}, ledger={}, state={})
    again = restore(cfg, cfg.trainer, SOLO, resume=True)
    assert again.checkpoint.step == 1
    assert all(torch.equal(again.engine.state_dict()[n], t) for n, t in first.state_dict().items())
    moments, restored = first.optimizer_state()[0], again.engine.optimizer_state()[0]
    assert set(moments) == set(restored) and all(torch.equal(restored[k], t) for k, t in moments.items())


# -- stream-rl export -------------------------------------------------------------------------------------------


def test_export_merges_a_lora_checkpoint_into_a_plain_pretrained_directory(tmp_path):
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from stream_rl.cli.main import app
    from stream_rl.demo.tokenizer import build_tokenizer

    base_dir = tmp_path / "base"
    tiny_policy(seed=0).save_pretrained(base_dir)
    build_tokenizer().save_pretrained(base_dir)
    cfg = lora_cfg(advantage="gae")  # the value head is trained and checkpointed, but not exported
    engine = lora_engine(cfg=cfg, value_head=True)
    train_once(engine, cfg)
    train_once(engine, cfg, seed=1)
    ckpt = save_checkpoint(tmp_path / "ckpts", step=2, version=2, engine=engine, offsets={}, ledger={}, state={})
    assert (ckpt / "lora.json").is_file()
    out = tmp_path / "exported"
    args = ["export", "--checkpoint", str(ckpt), "--base", str(base_dir), "--out", str(out),
            "--set", "run.demo_dir=null"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out.resolve())
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name for name in model.state_dict())  # a plain model: no peft modules
    ids = torch.tensor([[3, 9, 4, 10, 5, 6], [8, 8, 2, 11, 11, 7]])
    torch.testing.assert_close(logits_of(model, ids), logits_of(engine.module.policy, ids), rtol=1e-5, atol=1e-5)
    again = CliRunner().invoke(app, args)  # an existing --out is refused without --overwrite
    assert again.exit_code == 2 and "exists" in again.output


def test_export_of_a_full_checkpoint_loads_its_weights(tmp_path):
    from consumers.trainer.export import export_checkpoint
    from stream_rl.demo.tokenizer import build_tokenizer

    base_dir = tmp_path / "base"
    tiny_policy(seed=0).save_pretrained(base_dir)
    build_tokenizer().save_pretrained(base_dir)
    cfg = trainer_cfg()
    engine = TorchEngine(TrainModule(tiny_policy(seed=0)), cfg)
    train_once(engine, cfg)
    ckpt = save_checkpoint(tmp_path / "ckpts", step=1, version=1, engine=engine, offsets={}, ledger={}, state={})
    assert not (ckpt / "lora.json").exists()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, base_dir, tmp_path / "out")).eval()
    ids = torch.tensor([[3, 9, 4, 10, 5, 6]])
    torch.testing.assert_close(logits_of(model, ids), logits_of(engine.module.policy, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["share_prompts", "packing"])
def test_lora_gives_the_padded_logprobs_and_adapter_gradients_on_either_forward_path(path):
    """LoRA under the shared-prompt forward and under sequence packing computes what padded rows compute: the same
    logprobs and the same gradient on every adapter (float32 sums in another order: within 1e-5)."""
    from support.trainer import assert_same_gradients

    from consumers.trainer.forward import response_logprobs

    items = [s for p in range(3) for s in random_group(tiny_policy(seed=0), p, group_size=3,
                                                         rng=np.random.default_rng(4), rewards=[1, 0, 0])]
    batch = build_batch(items)

    def forward(**module_kw):
        cfg = lora_cfg()
        module = TrainModule(wrap_policy(tiny_policy(seed=0), cfg.lora), **module_kw)
        for name, param in module.named_parameters():  # B = 0 at init: give the adapters a value to differ by
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05, generator=torch.Generator().manual_seed(len(name)))
        logp, _, _ = response_logprobs(TorchEngine(module, cfg), batch)
        (logp * batch.response_mask).sum().backward()
        return logp.detach(), {n: p.grad for n, p in module.named_parameters() if p.grad is not None}

    plain_logp, plain_grads = forward()
    logp, grads = forward(**{path: True})
    mask = batch.response_mask
    torch.testing.assert_close(logp[mask], plain_logp[mask], rtol=1e-5, atol=1e-5)
    assert all("lora_" in name for name in plain_grads) and len(plain_grads) == 12  # 2 layers x 3 modules x (A, B)
    assert_same_gradients(grads, plain_grads)
