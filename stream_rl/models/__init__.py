"""Models: strict local loading of policy, reference and reward models, atomic saves, broadcast state dicts, the
device and dtype settings as torch objects, and LoRA adapters (their wire tensors and the merge).

See `stream_rl.models.loading` for what is checked and guaranteed, `stream_rl.models.devices` for devices,
`stream_rl.models.lora` for adapters.
"""

from stream_rl.models.devices import resolve_device, torch_dtype
from stream_rl.models.loading import (
    ModelLoadError,
    check_weight_keys,
    freeze,
    load_policy,
    load_reference,
    load_reward_model,
    load_state_dict_strict,
    load_tokenizer,
    safetensors_shapes,
    save_model,
    state_dict_for_broadcast,
    tie_groups,
)

__all__ = [
    "ModelLoadError",
    "check_weight_keys",
    "freeze",
    "load_policy",
    "load_reference",
    "load_reward_model",
    "load_state_dict_strict",
    "load_tokenizer",
    "resolve_device",
    "safetensors_shapes",
    "save_model",
    "state_dict_for_broadcast",
    "tie_groups",
    "torch_dtype",
]
