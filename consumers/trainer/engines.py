"""Training engines behind one interface (:class:`TrainEngine`): plain torch and DeepSpeed ZeRO, on one rank or many
(gloo/NCCL).

Consumes: a :class:`TrainModule` (the policy plus an optional value head), the trainer config and the
:class:`~consumers.trainer.ranks.Ranks` it trains on (one by default).
Produces: ``forward`` (response-aligned logits and values), ``backward``, ``step`` (clip, guard, AdamW update),
``zero_grad``, ``state_dict`` (full CPU weights; with ``trainer.lora`` the trainable tensors only, the optimizer
holding only those: :mod:`~consumers.trainer.lora`), ``optimizer_state``/``load_optimizer_state`` and
``save``/``load`` of ``model.safetensors`` + ``optimizer.safetensors`` + ``optimizer.json`` in a directory.
Guarantees:
- ``step`` applies an update only when the global gradient norm is finite; otherwise the gradients are discarded,
  the weights and the optimizer state are left untouched and ``StepOutcome.applied`` is False.
- Gradients accumulate over every ``backward`` until ``step``; callers pre-scale each micro loss, the engines
  never divide by an accumulation count (DeepSpeed runs with ``scale_wrt_gas=False`` and a manual boundary).
- Data parallel: the gradient after ``step``'s reduction is the *sum* of the ranks' gradients (each micro loss is
  already divided by the minibatch's global normaliser), so N ranks compute the one-rank gradient. The torch
  engine sums every gradient in one flat all-reduce before clipping (weights and AdamW state stay replicated and
  identical); DeepSpeed averages over ranks, so its backward scales the loss by the world size, and ZeRO 1/2/3
  shard the optimizer state, gradients and (3) parameters across the ranks.
- The optimizer state is stored per parameter name (``{name}::exp_avg`` ...) in the same neutral format by both
  engines (:mod:`~consumers.trainer.optim_state`), with no pickle: tensors in safetensors, scalars (AdamW's step count) and hyper-parameters in JSON.
  A checkpoint written by one engine loads into the other.
- ``trainer.gradient_checkpointing``: every Hugging Face decoder layer keeps only its input and recomputes its
  activations in backward (non-reentrant ``torch.utils.checkpoint``); only the layer objects are flagged
  ``training`` (:func:`mark_checkpointed_layers`), so the function computed is the eval-mode one.
- Dropout is off (``eval()`` mode throughout): the proximal recomputation and the training forward see the same
  function, as the sampler did.
- Device and precision: the module lives on ``trainer.device`` (``auto``: CUDA when torch sees a GPU, else CPU; an
  explicit CUDA device without one is a ``ValueError`` naming the field; with several ranks each uses
  ``cuda:LOCAL_RANK``). With ``trainer.dtype = "bfloat16"`` the
  forward runs under ``torch.autocast`` in bf16 (the logits come out bf16 and go to the chunked logprob kernel as
  they are), while the parameters, their gradients and the AdamW state stay fp32 (mixed precision with fp32
  master weights). Checkpoints hold the fp32 weights either way.

The DeepSpeed engine and its notes: :mod:`~consumers.trainer.deepspeed_engine`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import math
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from consumers.trainer import optim_state
from consumers.trainer.config import TrainerConfig
from consumers.trainer.activations import enable_checkpointing, mark_checkpointed_layers
from consumers.trainer.lora import is_lora
from consumers.trainer.packing import packed_forward
from consumers.trainer.prefix import can_share_prompts, shared_prompt_forward
from consumers.trainer.ranks import SOLO, Ranks
from stream_rl.storage.checkpoint import read_json, read_tensors, write_json, write_tensors

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
LORA_META = "lora.json"  # trainer.lora's settings, in a LoRA checkpoint only (stream-rl export reads them)


class TrainModule(nn.Module):
    """The trained module: a causal-LM policy and, for GAE, a linear value head on its last hidden state."""

    def __init__(self, policy: nn.Module, value_head: bool = False, share_prompts: bool = False,
                 packing: bool = False, pack_length: int | None = None, gradient_checkpointing: bool = False) -> None:
        super().__init__()
        if packing and share_prompts:
            raise ValueError("trainer.packing and trainer.share_prompts are alternative forward paths: set one false")
        self.policy = policy
        self.gradient_checkpointing = gradient_checkpointing  # trainer.gradient_checkpointing
        if gradient_checkpointing:
            enable_checkpointing(policy)
        self.share_prompts = share_prompts  # trainer.share_prompts: consumers.trainer.prefix
        self.packing, self.pack_length = packing, pack_length  # trainer.packing: consumers.trainer.packing
        self.value_head = None
        if value_head:
            self.value_head = nn.Linear(policy.config.hidden_size, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def train(self, mode: bool = True) -> TrainModule:
        """``nn.Module.train``; under gradient checkpointing the checkpointed layers stay flagged (see
        :func:`enable_checkpointing`) while everything else follows ``mode`` (the trainer runs in eval mode)."""
        super().train(mode)
        if self.gradient_checkpointing:
            mark_checkpointed_layers(self.policy)
        return self

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                response_width: int) -> tuple[Tensor, Tensor | None]:
        """Logits ``[B, T, V]`` predicting the T response tokens, and values ``[B, T]`` (or None)."""
        if self.packing or (self.share_prompts and can_share_prompts(self.policy)):
            run = partial(packed_forward, pack_length=self.pack_length) if self.packing else shared_prompt_forward
            logits, hidden = run(self.policy, input_ids, attention_mask, position_ids, response_width,
                                 hidden=self.value_head is not None)
            head = self.value_head
            return logits, None if hidden is None or head is None else head(hidden).squeeze(-1).float()
        keep = response_width + 1
        out = self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          logits_to_keep=keep, output_hidden_states=self.value_head is not None, use_cache=False)
        logits = out.logits[:, -keep:-1]  # [B, T, V]: positions P - 1 .. P + T - 2
        if self.value_head is None:
            return logits, None
        hidden = out.hidden_states[-1][:, -keep:-1]  # [B, T, H]
        return logits, self.value_head(hidden).squeeze(-1).float()  # [B, T]


@dataclass(frozen=True)
class StepOutcome:
    applied: bool
    grad_norm: float


@runtime_checkable
class TrainEngine(Protocol):
    """What the trainer's loop uses of an engine (``train_step``, ``update``, ``forward``, the versions' broadcast,
    ``keep_best``, the replica's restore, checkpoints): :class:`TorchEngine` and :class:`DeepSpeedEngine` are two.

    ``module`` is read for its shape only (``policy.config``, ``value_head``, ``packing``); the weights change
    through ``backward`` + ``step`` alone."""

    module: TrainModule
    ranks: Ranks
    device: torch.device
    lora: bool
    lora_settings: dict[str, Any] | None

    def forward(self, batch) -> tuple[Tensor, Tensor | None]: ...  # logits [B, T, V], values [B, T] or None
    def backward(self, loss: Tensor, *, last_micro: bool = True) -> None: ...
    def step(self, lr: float) -> StepOutcome: ...  # clip, finite-norm guard, AdamW update
    def zero_grad(self) -> None: ...
    def state_dict(self) -> dict[str, Tensor]: ...
    def load_state_dict(self, tensors: dict[str, Tensor]) -> None: ...
    def policy_state_dict(self) -> dict[str, Tensor]: ...  # Hugging Face names: what a broadcast sends
    def full_state(self) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Any]]: ...
    def optimizer_state(self) -> tuple[dict[str, Tensor], dict[str, Any]]: ...
    def load_optimizer_state(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None: ...
    def save(self, directory: str | os.PathLike) -> None: ...
    def load(self, directory: str | os.PathLike) -> None: ...


def make_optimizer(module: nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    trainable = [p for p in module.parameters() if p.requires_grad]  # LoRA: the adapters (and value head) only
    return torch.optim.AdamW(trainable, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                             foreach=False)


def unique_state(module: nn.Module) -> dict[str, Tensor]:
    """Full CPU copies of ``module``'s state, one name per group of tied tensors."""
    from stream_rl.models import tie_groups

    state = module.state_dict()
    return {g[0]: state[g[0]].detach().to("cpu", copy=True).contiguous() for g in tie_groups(module)}


def cast_floating(tensors: dict[str, Tensor], dtype: str) -> dict[str, Tensor]:
    """The floating-point tensors of ``tensors`` in ``dtype`` (a torch dtype name, e.g. the producers'
    ``producer.dtype``), the others as they are: what a broadcast sends, so a bf16 producer gets bf16 bytes."""
    target = getattr(torch, dtype)
    return {name: t.to(target) if t.is_floating_point() else t for name, t in tensors.items()}


def resolve_device(name: str, ranks: Ranks = SOLO) -> torch.device:
    """``trainer.device`` -> a torch device (:func:`stream_rl.models.resolve_device`); with several ranks, CUDA
    means this rank's ``cuda:LOCAL_RANK``."""
    from stream_rl.models import resolve_device as resolve

    device = resolve(name, "trainer.device")
    return ranks.device if ranks.world > 1 and device.type == "cuda" else device


class EngineBase(ABC):
    """What both engines share: placement, the autocast forward, the broadcast's weights, save and load."""

    module: TrainModule
    ranks: Ranks = SOLO
    lora: bool = False  # trainer.lora: the policy carries peft adapters on a frozen base (consumers.trainer.lora)
    lora_settings: dict[str, Any] | None = None
    device: torch.device = torch.device("cpu")
    compute_dtype: torch.dtype = torch.float32

    def _placed(self, cfg: TrainerConfig, ranks: Ranks) -> None:
        self.ranks = ranks
        self.device = resolve_device(cfg.device, ranks)
        self.compute_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32

    def forward(self, batch) -> tuple[Tensor, Tensor | None]:
        """Response logits ``[B, T, V]`` (bf16 under bf16 mixed precision) and values ``[B, T]`` (or None)."""
        args = (t.to(self.device) for t in (batch.input_ids, batch.attention_mask, batch.position_ids))
        bf16 = self.compute_dtype == torch.bfloat16
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            return self._call(*args, batch.response_width)

    def policy_state_dict(self) -> dict[str, Tensor]:
        """The policy's weights under their Hugging Face names (for the broadcast)."""
        prefix = "policy."
        policy = {k[len(prefix):]: v for k, v in self.state_dict().items() if k.startswith(prefix)}
        if self.lora:  # the adapters only, under their wire names (stream_rl.models.lora)
            from consumers.trainer.lora import adapter_state

            return adapter_state(policy)
        return policy

    def full_state(self) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Any]]:
        """Consolidated weights, optimizer tensors and optimizer JSON (collectives under ZeRO: every rank calls)."""
        return self.state_dict(), *self.optimizer_state()

    def save(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        weights, tensors, meta = self.full_state()
        write_tensors(directory / MODEL_FILE, weights)
        write_tensors(directory / OPTIMIZER_FILE, tensors)
        write_json(directory / OPTIMIZER_META, meta)
        if self.lora:
            write_json(directory / LORA_META, self.lora_settings)

    def load(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        self.load_state_dict(read_tensors(directory / MODEL_FILE))
        self.load_optimizer_state(read_tensors(directory / OPTIMIZER_FILE), read_json(directory / OPTIMIZER_META))

    def _named_params(self) -> dict[str, nn.Parameter]:
        return dict(self.module.named_parameters())

    # What each engine implements (TorchEngine, DeepSpeedEngine); the methods above are built on them.
    @abstractmethod
    def _call(self, *args: Any) -> tuple[Tensor, Tensor | None]: ...
    @abstractmethod
    def backward(self, loss: Tensor, *, last_micro: bool = True) -> None: ...
    @abstractmethod
    def step(self, lr: float) -> StepOutcome: ...
    @abstractmethod
    def zero_grad(self) -> None: ...
    @abstractmethod
    def state_dict(self) -> dict[str, Tensor]: ...
    @abstractmethod
    def load_state_dict(self, tensors: dict[str, Tensor]) -> None: ...
    @abstractmethod
    def optimizer_state(self) -> tuple[dict[str, Tensor], dict[str, Any]]: ...
    @abstractmethod
    def load_optimizer_state(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None: ...


class TorchEngine(EngineBase):
    """Plain torch: AdamW, ``clip_grad_norm_``, the finite-norm guard."""

    def __init__(self, module: TrainModule, cfg: TrainerConfig, ranks: Ranks = SOLO) -> None:
        self._placed(cfg, ranks)
        self.module = module.to(self.device, dtype=torch.float32).eval()  # fp32 master weights
        self.optimizer = make_optimizer(module, cfg)
        self.lora = is_lora(module)
        self.lora_settings = cfg.lora.model_dump(mode="json") if self.lora else None
        self.grad_clip = cfg.grad_clip

    def _call(self, *args):
        return self.module(*args)

    def backward(self, loss: Tensor, *, last_micro: bool = True) -> None:
        loss.backward()

    def step(self, lr: float) -> StepOutcome:
        if self.ranks.world > 1:  # every rank ends with the sum: identical clipping and updates everywhere
            self.ranks.all_reduce_grads([p for p in self.module.parameters() if p.requires_grad])
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return StepOutcome(False, 0.0)
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip or math.inf))
        if not math.isfinite(norm):
            self.zero_grad()
            return StepOutcome(False, norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.zero_grad()
        return StepOutcome(True, norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Tensor]:
        """Full weights; with LoRA the trainable tensors only (adapters, value head): the base never changes."""
        if self.lora:
            from consumers.trainer.lora import trainable_state

            return trainable_state(self.module)
        return unique_state(self.module)

    def load_state_dict(self, tensors: dict[str, Tensor]) -> None:
        from consumers.trainer.lora import load_module_state

        load_module_state(self.module, tensors, self.lora)

    def optimizer_state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        return optim_state.optimizer_state(self.module, self.optimizer)

    def load_optimizer_state(self, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
        optim_state.load_optimizer_state(self.module, self.optimizer, tensors, meta)


def build_engine(module: TrainModule, cfg: TrainerConfig, ranks: Ranks = SOLO) -> TrainEngine:
    """The engine ``cfg.engine`` names, around ``module``, on ``ranks``."""
    from consumers.trainer.deepspeed_engine import DeepSpeedEngine  # its module builds on this one

    engines = {"torch": TorchEngine, "deepspeed": DeepSpeedEngine}
    return engines[cfg.engine](module, cfg, ranks)
