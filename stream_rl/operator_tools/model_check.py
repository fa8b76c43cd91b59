"""The doctor's model-directory check: does each directory the config names hold a model the roles can load.

Consumes: a directory, the settings that name it (``trainer.model_dir``, ``--model-dir`` ...; see
:func:`~stream_rl.operator_tools.doctor.model_dirs`) and ``run.demo_dir``.
Produces: one :class:`~stream_rl.operator_tools.doctor.Check` row named ``model {path}``: ``pass`` when
``config.json`` and the tokenizer parse, the tokenizer fits the model's vocabulary, and the safetensors keys match
the model the config builds; ``warn`` for a demo model not built yet; ``fail`` with a remedy otherwise.
Guarantees: nothing is written and no tensor memory is used: the model is built on the meta device and only its
key names are compared with the files'; architectures whose tensors are renamed at load are not compared (the
loader's own rule). Only model-loading errors become rows; anything else propagates.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stream_rl.operator_tools.doctor import Check


def check_model_dir(path: Path, settings: Sequence[str], demo_dir: Path | None = None) -> Check:
    """config.json and the tokenizer parse, and the safetensors keys match the model the config builds."""
    from transformers import AutoConfig

    from stream_rl.models.loading import ModelLoadError, load_tokenizer

    name, used_by = f"model {path}", ", ".join(settings)
    if not path.is_dir():
        if demo_dir is not None and Path(demo_dir).resolve() in path.resolve().parents:
            return Check(name, "warn", f"not built yet ({used_by})",
                         f"`stream-rl run` builds the demo there; or `stream-rl demo init {demo_dir}`")
        return Check(name, "fail", f"directory does not exist ({used_by})",
                     f"point {used_by} at a save_pretrained directory")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:  # no config.json, bad JSON, unknown model_type
        return Check(name, "fail", f"config.json in {path} does not parse: {exc}",
                     "the directory needs the config.json written by save_pretrained")
    try:
        tokenizer = load_tokenizer(path)
        vocab = getattr(config, "vocab_size", None)
        if vocab is not None and len(tokenizer) > vocab:
            raise ModelLoadError(f"tokenizer in {path} has {len(tokenizer)} tokens, model vocabulary {vocab}")
    except ModelLoadError as exc:
        return Check(name, "fail", str(exc), "save the model's own tokenizer into the directory "
                     "(tokenizer.save_pretrained)")
    try:
        summary = _compare_keys(path, config, "scorer.reward_model_dir" in settings)
    except ModelLoadError as exc:
        return Check(name, "fail", str(exc), f"the weights do not belong to this config.json: re-save the model "
                     f"with save_pretrained, or point {used_by} at the matching directory")
    return Check(name, "pass", f"config, tokenizer ({len(tokenizer)} tokens) and {summary} ({used_by})")


def _compare_keys(path: Path, config: Any, reward_model: bool) -> str:
    """Build the model on the meta device (no memory) and compare its keys with the safetensors file(s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    # _has_checkpoint_conversions: the loader's own rule for architectures whose tensors are renamed at load
    from stream_rl.models.loading import ModelLoadError, _has_checkpoint_conversions, check_weight_keys

    classifier = reward_model or any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            skeleton = auto.from_config(config)
    except ValueError as exc:
        raise ModelLoadError(f"config.json in {path} is not understood by transformers: {exc}") from exc
    if _has_checkpoint_conversions(skeleton):
        return f"{type(skeleton).__name__} (renames tensors at load: names not compared)"
    check_weight_keys(path, skeleton)
    return f"{type(skeleton).__name__} weight keys match"
