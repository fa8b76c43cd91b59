"""Activation checkpointing of the trainer's policy (``trainer.gradient_checkpointing``).

Consumes: a Hugging Face causal LM (its decoder layers are ``GradientCheckpointingLayer``s).
Produces: the policy with every decoder layer checkpointed: in the training forward each layer keeps only its
input; backward re-runs the layer (non-reentrant ``torch.utils.checkpoint``) to get the activations it needs.
Guarantees:
- The same function: the trainer runs in eval mode (no dropout) and Hugging Face checkpoints a layer only when
  ``layer.training``; only the layer objects get that flag, their submodules (attention, dropout) stay in eval
  mode, so the loss and gradients equal the plain forward's up to float rounding (tests/unit/test_long_tail_memory.py).
- Memory: the saved activations of L layers drop from ``L * per_layer`` to ``L * layer_input + per_layer``
  (``stream_rl.planner.memory.activations_bytes``), at the cost of about one more forward.
- The key/value cache is off in a checkpointed layer, so the shared-prompt forward cannot run: the config refuses
  ``gradient_checkpointing`` with ``share_prompts`` (packing works with it).
"""

from __future__ import annotations

from torch import nn


def checkpointed_layers(policy: nn.Module) -> list[nn.Module]:
    """The policy's Hugging Face decoder layers that can recompute their activations
    (``GradientCheckpointingLayer``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in policy.modules() if isinstance(m, GradientCheckpointingLayer)]


def mark_checkpointed_layers(policy: nn.Module) -> None:
    """Set ``training`` on the checkpointed layer objects only (not on their submodules).

    Hugging Face checkpoints a layer only when ``layer.gradient_checkpointing and layer.training``; the trainer
    runs in eval mode (no dropout), so the flag is set on each layer object alone: its dropout and attention
    submodules keep ``training = False`` and compute exactly what they compute in eval mode."""
    for layer in checkpointed_layers(policy):
        layer.training = True


def enable_checkpointing(policy: nn.Module) -> None:
    """``trainer.gradient_checkpointing``: non-reentrant activation checkpointing of every decoder layer (each keeps
    its input, recomputes the rest in backward); a policy without checkpointable layers is a ValueError."""
    if not getattr(policy, "supports_gradient_checkpointing", False) or not checkpointed_layers(policy):
        raise ValueError(f"trainer.gradient_checkpointing=true: {type(policy).__name__} has no Hugging Face "
                         f"checkpointable decoder layers; set trainer.gradient_checkpointing=false")
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mark_checkpointed_layers(policy)
