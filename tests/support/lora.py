"""LoRA test helpers: the adapter settings the LoRA tests share (``LORA``), a policy with adapters trained one
step (``trained_adapters``), and the hf engine and logits readers that compare merged and unmerged policies."""

from __future__ import annotations

import numpy as np
import torch

from consumers.trainer.config import TrainerConfig  # noqa: E402
from consumers.trainer.engines import TorchEngine, TrainModule  # noqa: E402
from consumers.trainer.lora import wrap_policy  # noqa: E402
from consumers.trainer.tensors import build_batch  # noqa: E402
from consumers.trainer.train_step import TrainState, train_step  # noqa: E402
from support.trainer import random_group, tiny_policy, trainer_cfg

LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def lora_cfg(**overrides) -> TrainerConfig:
    return trainer_cfg(lora=LORA, **overrides)


def lora_engine(seed: int = 0, cfg: TrainerConfig | None = None, value_head: bool = False) -> TorchEngine:
    cfg = cfg or lora_cfg()
    return TorchEngine(TrainModule(wrap_policy(tiny_policy(seed=seed), cfg.lora), value_head=value_head), cfg)


def train_once(engine: TorchEngine, cfg: TrainerConfig, seed: int = 0) -> None:
    policy = engine.module.policy
    items = [s for p in range(2) for s in random_group(policy, p, rng=np.random.default_rng(seed), rewards=[1, 0])]
    train_step(engine, build_batch(items), cfg, TrainState())


def hf_engine(seed: int = 0):
    from producers.engines.hf import HFEngine
    from stream_rl.demo.tokenizer import build_tokenizer

    return HFEngine(tiny_policy(seed=seed), build_tokenizer())


def trained_adapters(steps: int = 1, seed: int = 0) -> tuple[TorchEngine, dict[str, torch.Tensor]]:
    cfg = lora_cfg()
    engine = lora_engine(cfg=cfg)
    for s in range(steps):
        train_once(engine, cfg, seed=seed + s)
    return engine, engine.policy_state_dict()


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def random_adapter(model_dir, modules: tuple[str, ...], rank: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """Wire-named adapter tensors (``{module}.lora_A.weight`` [r, in], ``.lora_B.weight`` [out, r]) for ``modules``
    of every layer of the tiny model, with B != 0 so the version changes the policy."""
    from stream_rl.models.loading import safetensors_shapes

    shapes = safetensors_shapes(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module in modules:
            path = f"model.layers.{layer}.{module}"
            out_dim, in_dim = shapes[f"{path}.weight"]
            tensors[f"{path}.lora_A.weight"] = 0.3 * torch.randn(rank, in_dim, generator=gen)
            tensors[f"{path}.lora_B.weight"] = 0.3 * torch.randn(out_dim, rank, generator=gen)
    return tensors
