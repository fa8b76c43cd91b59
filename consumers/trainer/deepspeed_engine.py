"""The DeepSpeed ZeRO engine (``trainer.engine = "deepspeed"``): the :class:`~consumers.trainer.engines.TrainEngine`
of :func:`~consumers.trainer.engines.build_engine` that shards the optimizer state, gradients and (stage 3)
parameters over the trainer's ranks.

Consumes: a :class:`~consumers.trainer.engines.TrainModule`, the trainer config (``zero_stage``, ``grad_clip``,
the AdamW settings) and the :class:`~consumers.trainer.ranks.Ranks` it trains on (one by default: a single-process
``torch.distributed`` group is set up unless torchrun set one).
Produces: what every engine produces (:mod:`~consumers.trainer.engines`): ``backward``, ``step``, full CPU weights
(gathered under ZeRO 3) and the optimizer state in the neutral per-parameter format of
:mod:`~consumers.trainer.optim_state`, read from and written into ZeRO's fp32 master copy.
Guarantees (beside those of :mod:`~consumers.trainer.engines`):
- ``step`` is applied only when DeepSpeed applied it and the global gradient norm is finite.
- DeepSpeed averages gradients over ranks; ``backward`` scales the loss by the world size, so the ranks' gradients
  sum as the torch engine's do.
- A checkpoint written by the torch engine loads here and the other way round (tied weights resolved by name).

DeepSpeed notes: ZeRO stages 1-3 each skip a step whose gradient norm is not finite and clear their internal
buffers (a plain ``zero_grad`` does not clear them); the trainer therefore routes a non-finite loss through that
same path on every engine (it back-propagates NaN, see :mod:`~consumers.trainer.update`). A ``torch.optim.AdamW``
instance is passed in, so no fused-Adam JIT build happens.
"""

from __future__ import annotations

import math
import os
import socket
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from consumers.trainer.config import TrainerConfig
from consumers.trainer.engines import StepOutcome, TrainModule, EngineBase, make_optimizer, unique_state
from consumers.trainer.optim_state import SEP, group_json, scalar_json
from consumers.trainer.ranks import SOLO, Ranks
from stream_rl.storage.checkpoint import CheckpointError


def _dist_env() -> None:
    """Single-process torch.distributed settings for DeepSpeed, unless torchrun (or the caller) set them."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)



class DeepSpeedEngine(EngineBase):
    """DeepSpeed ZeRO (``cfg.zero_stage``) over the trainer's ranks; see the module docstring."""

    def __init__(self, module: TrainModule, cfg: TrainerConfig, ranks: Ranks = SOLO) -> None:
        _dist_env()
        import deepspeed

        self._placed(cfg, ranks)
        module = module.to(self.device, dtype=torch.float32)  # fp32 master weights; bf16 compute by autocast
        self.stage = cfg.zero_stage
        config = {
            "train_batch_size": ranks.world, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": float(cfg.grad_clip or 0.0), "zero_optimization": {"stage": cfg.zero_stage},
            "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False,
        }
        self.optimizer = make_optimizer(module, cfg)
        self.ds, _, _, _ = deepspeed.initialize(model=module, optimizer=self.optimizer, config=config)
        self.module = module.eval()

    def _call(self, *args):
        return self.ds(*args)

    def backward(self, loss: Tensor, *, last_micro: bool = True) -> None:
        self.ds.set_gradient_accumulation_boundary(last_micro)
        self.ds.backward(loss * self.ranks.world, scale_wrt_gas=False)  # ZeRO averages over ranks; we sum

    def step(self, lr: float) -> StepOutcome:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.ds.set_gradient_accumulation_boundary(True)
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = math.inf if norm is None else float(norm)
        applied = bool(self.ds.was_step_applied()) and math.isfinite(norm)
        return StepOutcome(applied, norm)

    def zero_grad(self) -> None:
        self.ds.zero_grad()

    def _gathered(self):
        import deepspeed

        if self.stage == 3:
            return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=0)
        return nullcontext()

    def state_dict(self) -> dict[str, Tensor]:
        with self._gathered():
            return unique_state(self.module)

    def load_state_dict(self, tensors: dict[str, Tensor]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        from stream_rl.models import load_state_dict_strict

        with self._gathered():
            load_state_dict_strict(self.module, tensors)
        params = self._named_params()
        full = {name: p.detach().clone() for name, p in params.items()} if self.stage != 3 else None
        for name, param in params.items():  # the fp32 master copy lives in the ZeRO optimizer
            value = full[name] if full is not None else _tensor_for(name, tensors, self.module)
            safe_set_full_fp32_param(param, value)

    def optimizer_state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        from deepspeed.utils import safe_get_full_optimizer_state

        tensors, scalars = {}, {}
        steps = {scalar_json("step", s["step"])["value"] for s in self.optimizer.state.values() if "step" in s}
        for name, param in self._named_params().items():
            for key in ("exp_avg", "exp_avg_sq"):
                value = safe_get_full_optimizer_state(param, key)
                if value is not None:
                    tensors[f"{name}{SEP}{key}"] = value.detach().to("cpu", copy=True).contiguous()
            if steps:
                scalars[f"{name}{SEP}step"] = {"value": max(steps), "dtype": "float32"}
        return tensors, {"optimizer": "adamw", "scalars": scalars,
                         "param_groups": [group_json(g) for g in self.optimizer.param_groups]}

    def load_optimizer_state(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        for group in self.optimizer.param_groups:  # AdamW creates its state lazily, at the first step
            for flat in group["params"]:
                self.optimizer.state.setdefault(flat, {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                                                       "exp_avg_sq": torch.zeros_like(flat)})
        link = getattr(self.ds.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # ZeRO 1/2 link per-parameter views into that state after the first step only
            link()
        params = self._named_params()
        for full, value in tensors.items():
            name, key = full.rsplit(SEP, 1)
            if name not in params:
                raise CheckpointError(f"optimizer state for unknown parameter {name!r}")
            safe_set_full_optimizer_state(params[name], value, key)
        steps = {entry["value"] for full, entry in meta["scalars"].items() if full.endswith(f"{SEP}step")}
        for state in self.optimizer.state.values():
            if steps and "step" in state:
                state["step"] = torch.tensor(float(max(steps)), dtype=torch.float32)



def _tensor_for(name: str, tensors: dict[str, Tensor], module: nn.Module) -> Tensor:
    from stream_rl.models import tie_groups

    for group in tie_groups(module):
        if name in group:
            return tensors[next(n for n in group if n in tensors)]
    return tensors[name]

