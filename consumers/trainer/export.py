"""``stream-rl export``: a trainer checkpoint as a standalone ``save_pretrained`` directory.

Consumes: a checkpoint directory (``model.safetensors``, and ``lora.json`` when it was trained with
``trainer.lora``), the base model directory it was trained from (``trainer.model_dir``: its config, tokenizer and,
for LoRA, its frozen weights) and an output path.
Produces: ``{out}/`` with the policy's weights (safetensors), ``config.json`` and the tokenizer, written atomically
(:func:`stream_rl.models.save_model`).
Guarantees:
- A LoRA checkpoint is merged: every adapted weight becomes ``W0 + (alpha / r) * B A`` (``peft``'s
  ``merge_and_unload``, with the rank, alpha and target modules recorded in ``lora.json``), so the directory loads
  with ``AutoModelForCausalLM.from_pretrained`` alone, no ``peft``, and gives the trainer's logits.
- A full checkpoint's policy weights are loaded strictly (every name, every shape) into the base's architecture.
- The value head (``advantage = "gae"``) is not part of the policy and is left out.
- An existing ``out`` is refused unless ``overwrite``.
"""

from __future__ import annotations

import os
from pathlib import Path

from consumers.trainer.config import LoraConfig
from consumers.trainer.engines import LORA_META, MODEL_FILE
from stream_rl.storage.checkpoint import CheckpointError, read_json, read_tensors

_POLICY = "policy."


def export_checkpoint(checkpoint: str | os.PathLike, model_dir: str | os.PathLike, out: str | os.PathLike, *,
                      overwrite: bool = False) -> Path:
    """Write the policy of ``checkpoint`` (trained from ``model_dir``) to ``out``; returns the resolved path."""
    from stream_rl.models import load_policy, load_state_dict_strict, load_tokenizer, save_model

    checkpoint = Path(checkpoint)
    if Path(out).exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    weights = read_tensors(checkpoint / MODEL_FILE)
    policy_state = {k[len(_POLICY):]: t for k, t in weights.items() if k.startswith(_POLICY)}
    if not policy_state:
        raise CheckpointError(f"{checkpoint / MODEL_FILE} holds no policy weights")
    if (checkpoint / LORA_META).is_file():
        from consumers.trainer.lora import merged_policy

        lora = LoraConfig(**read_json(checkpoint / LORA_META))
        model = merged_policy(model_dir, lora, policy_state)
    else:
        model, _ = load_policy(model_dir)
        load_state_dict_strict(model, policy_state)
    return save_model(model, load_tokenizer(model_dir), out, overwrite=overwrite)
