"""Activation checkpointing (trainer.gradient_checkpointing): the same logprobs, loss and gradients as the plain
forward (padded and packed), the eval-mode function kept, a memory probe of the saving on CPU, and the config
refusing it with the shared-prompt forward."""

from __future__ import annotations

import pytest
import torch
from support.memory_probe import peak_cpu_bytes
from support.taps import GradientTap
from support.trainer import assert_same_gradients, random_batch, tiny_policy, trainer_cfg

from consumers.trainer.activations import checkpointed_layers, enable_checkpointing
from consumers.trainer.engines import TorchEngine, TrainModule
from consumers.trainer.forward import response_logprobs
from consumers.trainer.train_step import TrainState, train_step
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError
from stream_rl.planner import memory as mem

torch.set_num_threads(1)


def _forward_backward(batch, checkpointing: bool, packing: bool):
    module = TrainModule(tiny_policy(seed=0), value_head=True, packing=packing,
                         gradient_checkpointing=checkpointing)
    engine = TorchEngine(module, trainer_cfg(share_prompts=False, packing=packing))
    torch.nn.init.normal_(module.value_head.weight, generator=torch.Generator().manual_seed(1))
    logp, _, values = response_logprobs(engine, batch)
    mask = batch.response_mask
    ((logp * mask).sum() + (values * mask).sum()).backward()
    return logp.detach(), values.detach(), {n: p.grad.clone() for n, p in module.named_parameters()
                                            if p.grad is not None}


@pytest.mark.parametrize("packing", [False, True])
def test_checkpointed_layers_give_the_same_logprobs_values_and_gradients(packing):
    batch = random_batch(tiny_policy(seed=0), groups=3, seed=2, temperature=0.8)
    lp, vp, gp = _forward_backward(batch, False, packing)
    lc, vc, gc = _forward_backward(batch, True, packing)
    mask = batch.response_mask
    torch.testing.assert_close(lc[mask], lp[mask], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(vc[mask], vp[mask], rtol=1e-6, atol=1e-6)
    assert_same_gradients(gc, gp)


def test_a_checkpointed_training_step_matches_the_plain_one():
    batch = random_batch(tiny_policy(seed=0), groups=2, group_size=4, seed=7)
    out = []
    for checkpointing in (False, True):
        cfg = trainer_cfg(share_prompts=False, gradient_checkpointing=checkpointing, epochs=2)
        module = TrainModule(tiny_policy(seed=0), gradient_checkpointing=checkpointing)
        engine = TorchEngine(module, cfg)
        tap = GradientTap(engine)
        out.append((train_step(engine, batch, cfg, TrainState()), tap.grads))
    (plain, plain_grads), (ckpt, ckpt_grads) = out
    for key in ("loss/total", "optim/grad_norm", "policy/entropy"):
        assert ckpt[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    for g, w in zip(ckpt_grads, plain_grads, strict=True):
        assert_same_gradients(g, w)


def test_only_the_layer_objects_are_flagged_training_the_function_stays_eval_mode():
    module = TrainModule(tiny_policy(seed=0), gradient_checkpointing=True).eval()
    layers = checkpointed_layers(module.policy)
    assert len(layers) == 2 and all(layer.training and layer.gradient_checkpointing for layer in layers)
    inside = [m for layer in layers for m in layer.modules() if m is not layer]
    assert inside and not any(m.training for m in inside)  # attention, MLP, norms: eval mode
    assert not module.policy.training
    with pytest.raises(ValueError, match="trainer.gradient_checkpointing=true: Linear has no Hugging Face"):
        enable_checkpointing(torch.nn.Linear(2, 2))


def _wide_policy(layers: int):
    """A tiny Llama with room for long sequences: hidden 64, MLP 128, ``layers`` layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _peak(checkpointing: bool, layers: int, rows: int = 4, width: int = 256) -> int:
    module = TrainModule(_wide_policy(layers), gradient_checkpointing=checkpointing).eval()
    ids = torch.randint(3, 16, (rows, width), generator=torch.Generator().manual_seed(0))  # [B, L]
    mask, positions = torch.ones_like(ids), torch.arange(width).expand(rows, width)

    def forward_backward():
        logits, _ = module(ids, mask, positions, 8)  # [B, 8, V]: the activations of all L positions are kept
        logits.float().sum().backward()

    return peak_cpu_bytes(forward_backward)


def test_memory_probe_checkpointing_keeps_layer_inputs_instead_of_layer_activations():
    """Saved activations: L * per_layer plain, L * layer_input + per_layer checkpointed (planner formula); with
    4 layers the measured peak must fall below half, and each extra layer must cost less checkpointed."""
    plain4, ckpt4 = _peak(False, 4), _peak(True, 4)
    plain6, ckpt6 = _peak(False, 6), _peak(True, 6)
    assert ckpt4 < 0.5 * plain4
    per_layer_plain, per_layer_ckpt = (plain6 - plain4) / 2, (ckpt6 - ckpt4) / 2
    assert per_layer_ckpt < 0.25 * per_layer_plain
    # the planner's formula predicts the same direction for these sizes (fp32, eager-free sdpa, SwiGLU)
    s, b, h = 256, 4, 64
    one = mem.activation_bytes_per_layer(s, b, h, h, h, 2, 128, gated=True, flash_attention=True, e=4)
    assert mem.activations_bytes(6, one, 4 * s * b * h, True) < 0.5 * mem.activations_bytes(6, one, 0, False)


def test_config_refuses_checkpointing_with_the_shared_prompt_forward():
    def load(**overrides):
        return load_config(None, env={}, overrides=overrides)

    with pytest.raises(ConfigError, match=r"gradient_checkpointing=true with share_prompts=true.*set "
                                          r"share_prompts=false"):
        load(**{"trainer.gradient_checkpointing": "true"})
    cfg = load(**{"trainer.gradient_checkpointing": "true", "trainer.share_prompts": "false"})
    assert cfg.trainer.gradient_checkpointing and not load().trainer.gradient_checkpointing
