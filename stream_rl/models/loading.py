"""Strict loading and saving of Hugging Face models from local directories.

Consumes: a local directory in the `save_pretrained` layout: `config.json`, weights as `model.safetensors` or
as shards listed in `model.safetensors.index.json`, and the tokenizer files. Nothing is ever downloaded
(`local_files_only=True`) and no remote code is run.

Produces: a policy (`AutoModelForCausalLM`, train mode), a frozen reference (eval mode, `requires_grad=False`)
or a reward model (`AutoModelForSequenceClassification`, one label, frozen), each with its tokenizer; atomic
saves; CPU state dicts for the weight broadcast and a strict loader for them.

Guarantees:
- Pickled weights (`pytorch_model.bin`, `*.pt`, ...) are never read: a directory that only has those raises
  `ModelLoadError`. Where safetensors are present too, only the safetensors are read.
- Before loading, the tensor names in the safetensors file(s) are compared with those of the model built from
  the config on the meta device (no memory is allocated). Every expected key must be present and none may be
  left over; a tied weight (e.g. `lm_head.weight` tied to `model.embed_tokens.weight`) counts as present when
  any member of its tie group is in the file. Shapes are compared too. After loading, transformers' own
  loading report must be empty as well. Any mismatch raises `ModelLoadError` naming the first keys and counts.
  Architectures for which transformers renames or fuses checkpoint tensors at load time (some MoE models) skip
  the literal name comparison and rely on the post-load report alone.
- `save_model` writes into a temporary directory next to the target, fsyncs every file and the directory,
  then renames it into place: a reader sees either no directory or a complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stream_rl.storage.fsync import fsync_path, fsync_tree

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_SHOW = 5  # how many key names an error message lists per category


class ModelLoadError(RuntimeError):
    """A model directory or a set of tensors does not match the model it should fill."""


def load_tokenizer(path: str | os.PathLike, *, padding_side: str = "left") -> Any:
    """Load the tokenizer saved in `path` (left padding by default, as generation needs)."""
    from transformers import AutoTokenizer

    directory = _checked_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"no loadable tokenizer in {directory}: {exc}") from exc
    tokenizer.padding_side = padding_side
    return tokenizer


def load_policy(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a trainable causal LM and its tokenizer; returns `(model, tokenizer)` with the model in train mode."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = _load(path, AutoModelForCausalLM, dtype, device)
    model.train()
    return model, tokenizer


def load_reference(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a frozen causal LM (eval mode, no gradients) and its tokenizer; returns `(model, tokenizer)`."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = _load(path, AutoModelForCausalLM, dtype, device)
    return freeze(model), tokenizer


def load_reward_model(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
):
    """Load a frozen one-label sequence classifier and its tokenizer; returns `(model, tokenizer)`.

    The classifier scores the last non-padding token, found through `config.pad_token_id`; when the config has
    none, the tokenizer's pad token id is written into the loaded config (not into the directory). The tokenizer
    pads on the RIGHT, so a plain batched forward pass scores correctly without `position_ids`.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = _load_config(path, AutoConfig)
    if config.num_labels != 1:
        raise ModelLoadError(f"a reward model needs num_labels=1, {path} has {config.num_labels}")
    model, tokenizer = _load(path, AutoModelForSequenceClassification, dtype, device)
    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"
    return freeze(model), tokenizer


def freeze(model: nn.Module) -> nn.Module:
    """Put `model` in eval mode with `requires_grad=False` on every parameter; returns it."""
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def check_weight_keys(path: str | os.PathLike, model: nn.Module) -> None:
    """Compare the safetensors tensors in `path` with `model`'s state dict (a meta-device model is fine).

    Raises `ModelLoadError` naming missing keys (no member of a tie group in the file), unexpected keys and keys
    whose shape differs.
    """
    file_shapes = safetensors_shapes(path)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = [group[0] for group in tie_groups(model) if not any(name in file_shapes for name in group)]
    unexpected = sorted(set(file_shapes) - set(expected))
    mismatched = sorted(
        f"{name} (file {list(shape)}, model {list(expected[name])})"
        for name, shape in file_shapes.items()
        if name in expected and shape != expected[name]
    )
    _raise_on_mismatch(f"weights in {path}", missing, unexpected, mismatched)


def safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor in the directory's safetensors file or shards (read lazily)."""
    from safetensors import safe_open

    directory = _checked_dir(path)
    files = _weight_files(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        listed = set(json.loads(index.read_text())["weight_map"])
        _raise_on_mismatch(f"shards listed by {index}", sorted(listed - set(shapes)), sorted(set(shapes) - listed))
    return shapes


def tie_groups(model: nn.Module) -> list[list[str]]:
    """State-dict names grouped by the tensor they share, in state-dict order; untied names form singletons."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def state_dict_for_broadcast(model: nn.Module) -> dict[str, torch.Tensor]:
    """A snapshot of `model`'s weights: contiguous CPU copies, one name per tied group (the first in order).

    The copies do not alias the model, so later optimizer steps do not change what is being sent.
    """
    state = model.state_dict()
    return {
        group[0]: state[group[0]].detach().to("cpu", copy=True).contiguous() for group in tie_groups(model)
    }


def load_state_dict_strict(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy `tensors` into `model` in place, refusing any missing, unexpected or wrongly shaped name.

    A tied group needs only one of its names (as `state_dict_for_broadcast` sends); tensors are cast to the
    parameter's dtype and device.
    """
    expected = model.state_dict()
    groups = tie_groups(model)
    missing = [group[0] for group in groups if not any(name in tensors for name in group)]
    unexpected = sorted(set(tensors) - set(expected))
    mismatched = sorted(
        f"{name} (given {list(t.shape)}, model {list(expected[name].shape)})"
        for name, t in tensors.items()
        if name in expected and tuple(t.shape) != tuple(expected[name].shape)
    )
    _raise_on_mismatch("tensors", missing, unexpected, mismatched)
    full = {}
    for group in groups:
        source = tensors[next(name for name in group if name in tensors)]
        full.update({name: source for name in group})
    model.load_state_dict(full, strict=True)


def save_model(model: Any, tokenizer: Any, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Save `model` (safetensors) and `tokenizer` into `path` atomically; returns the resolved path.

    With `overwrite=True` an existing directory is replaced: it is renamed aside, the new one renamed in, and
    the old one removed (a crash in between leaves the old copy as `.<name>.old-*` next to it).
    """
    target = Path(path).resolve()
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)  # safetensors: the only format in transformers 5, the default in 4.x
        _weight_files(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        fsync_tree(tmp)
        if target.exists():
            os.rename(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            if old.exists():
                os.rename(old, target)
            raise
        fsync_path(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    if old.exists():
        shutil.rmtree(old)
    return target


def _load(path: str | os.PathLike, auto_class: Any, dtype: torch.dtype, device: str | torch.device):
    """Check keys on a meta-device model, load, check transformers' report, then load the tokenizer."""
    from transformers import AutoConfig

    directory = _checked_dir(path)
    config = _load_config(directory, AutoConfig)
    _weight_files(directory)  # refuses pickled-only directories before anything is built
    with torch.device("meta"):
        skeleton = auto_class.from_config(config)
    if not _has_checkpoint_conversions(skeleton):
        check_weight_keys(directory, skeleton)
    del skeleton
    model, info = auto_class.from_pretrained(
        directory,
        local_files_only=True,
        use_safetensors=True,
        trust_remote_code=False,
        dtype=dtype,
        output_loading_info=True,
    )
    _raise_on_mismatch(
        f"weights loaded from {directory}",
        sorted(info.get("missing_keys", ())),
        sorted(info.get("unexpected_keys", ())),
        sorted(str(item) for item in info.get("mismatched_keys", ())),
        list(info.get("error_msgs", ())),
    )
    tokenizer = load_tokenizer(directory)
    if len(tokenizer) > model.config.vocab_size:
        raise ModelLoadError(
            f"tokenizer in {directory} has {len(tokenizer)} tokens, model vocabulary {model.config.vocab_size}"
        )
    return model.to(device), tokenizer


def _load_config(path: str | os.PathLike, auto_config: Any) -> Any:
    directory = _checked_dir(path)
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {directory}")
    return auto_config.from_pretrained(directory, local_files_only=True, trust_remote_code=False)


def _checked_dir(path: str | os.PathLike) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist or is not a directory")
    return directory


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files to read; refuses a directory that only holds pickled weights."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [name for name in names if not (directory / name).is_file()]
        if absent:
            raise ModelLoadError(f"{index} lists shard files that do not exist: {absent[:_SHOW]}")
        return [directory / name for name in names]
    if (directory / SAFETENSORS_FILE).is_file():
        return [directory / SAFETENSORS_FILE]
    pickled = sorted(p.name for p in directory.iterdir() if p.name.endswith(PICKLED_WEIGHT_SUFFIXES))
    if pickled:
        raise ModelLoadError(
            f"{directory} holds only pickled weights {pickled[:_SHOW]}; they are refused because unpickling can run"
            " arbitrary code. Load them once in a trusted environment and re-save with save_pretrained (safetensors)."
        )
    raise ModelLoadError(f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {directory}")


def _has_checkpoint_conversions(model: nn.Module) -> bool:
    """Whether transformers renames or fuses this architecture's checkpoint tensors at load time."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4.x: names on disk are the module names
        return False
    return bool(get_model_conversion_mapping(model, add_legacy=False))


def _raise_on_mismatch(
    what: str,
    missing: list[str],
    unexpected: list[str],
    mismatched: Iterable[str] = (),
    errors: Iterable[str] = (),
) -> None:
    parts = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", list(mismatched))):
        if names:
            more = f" and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
            parts.append(f"{len(names)} {label}: {', '.join(names[:_SHOW])}{more}")
    parts.extend(f"error: {message}" for message in errors)
    if parts:
        raise ModelLoadError(f"{what} do not match the model: " + "; ".join(parts))
