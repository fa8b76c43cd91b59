"""The trainer's LoRA side (``trainer.lora``): the policy wrapped by ``peft``, its trainable state, its broadcast.

Consumes: a causal-LM policy and :class:`~consumers.trainer.config.LoraConfig`; for :func:`merged_policy` a base
model directory and the adapter tensors of a checkpoint.
Produces: a ``peft`` model whose only trainable parameters are the adapters (the base is frozen), the trainable
state of a :class:`~consumers.trainer.engines.TrainModule` (adapters, and the value head when there is one), the
adapters under their wire names (:mod:`stream_rl.models.lora`) for a broadcast, and a plain merged model for
``stream-rl export``.
Guarantees:
- The base weights never change and are never copied: ``peft`` keeps them as the frozen ``base_layer`` of each
  adapted module. The reference policy of a LoRA run is that same frozen base: the trainer computes no reference
  logprobs (the scorer does, from ``scorer.reference_model_dir``, which a LoRA run points at the base
  ``trainer.model_dir``), so no second copy of the model is held here.
- Checkpoints and broadcasts hold the trainable tensors only; :func:`load_trainable` refuses (``CheckpointError``)
  tensors that are not exactly the module's trainable set or that have the wrong shape.
- ``peft`` is imported only when LoRA is enabled (the ``lora`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor, nn

from consumers.trainer.config import LoraConfig
from stream_rl.models.lora import wire_name
from stream_rl.storage.checkpoint import CheckpointError


def wrap_policy(policy: nn.Module, cfg: LoraConfig) -> nn.Module:
    """``policy`` with LoRA adapters on ``cfg.target_modules`` (B = 0: the wrapped policy equals the base)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as exc:
        raise ImportError("trainer.lora.enabled = true needs the peft library: pip install -e '.[lora]' (make test "
                          "installs it)") from exc

    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=list(cfg.target_modules), bias="none")
    try:
        return get_peft_model(policy, peft_cfg)
    except ValueError as exc:  # e.g. no module matches target_modules
        raise ValueError(f"trainer.lora.target_modules={list(cfg.target_modules)}: {exc}") from exc


def is_lora(module: nn.Module) -> bool:
    """Whether ``module`` (a policy or a TrainModule) carries peft adapters."""
    return any(".lora_A." in name for name, _ in module.named_parameters())


def trainable_state(module: nn.Module) -> dict[str, Tensor]:
    """CPU copies of the parameters that require gradients, under ``module``'s parameter names."""
    return {name: p.detach().to("cpu", copy=True).contiguous()
            for name, p in module.named_parameters() if p.requires_grad}


def load_trainable(module: nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Copy ``tensors`` into ``module``'s trainable parameters (exactly that set, same shapes)."""
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    wrong = sorted(n for n in set(params) & set(tensors) if tuple(params[n].shape) != tuple(tensors[n].shape))
    if missing or unexpected or wrong:
        raise CheckpointError(f"adapter tensors do not fit the LoRA model: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}, wrong shape {wrong[:3]} (same trainer.lora settings?)")
    for name, param in params.items():
        param.data.copy_(tensors[name].to(param.device, param.dtype))


def load_module_state(module: nn.Module, tensors: Mapping[str, Tensor], lora: bool) -> None:
    """A checkpoint's weights into ``module``: the trainable tensors with LoRA, else every weight (strict)."""
    from stream_rl.models import load_state_dict_strict

    if lora:
        load_trainable(module, tensors)
    else:
        load_state_dict_strict(module, tensors)


def adapter_state(policy_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapter tensors of a peft policy's trainable state under their wire names (what a version carries)."""
    return {wire_name(name): t for name, t in policy_state.items()}


def merged_policy(model_dir: str | os.PathLike, cfg: LoraConfig, policy_state: Mapping[str, Tensor]) -> nn.Module:
    """The base in ``model_dir`` with ``policy_state`` (the peft policy's trainable tensors) merged into it: a plain
    transformers model, no adapter modules left."""
    from stream_rl.models import load_policy

    policy, _ = load_policy(model_dir)
    peft_model = wrap_policy(policy, cfg)
    load_trainable(peft_model, policy_state)
    return peft_model.merge_and_unload()
