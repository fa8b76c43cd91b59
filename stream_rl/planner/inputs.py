"""The planner's inputs: what ``stream-rl plan`` is asked about, validated once.

Consumes: the model as a :class:`~stream_rl.planner.model_size.ModelShape` or a parameter count, the dtype,
optimizer, ZeRO stage, GPUs (count, memory, per machine), trainer ranks, batch and generation sizes, the reference
and reward models, the headroom and the inference servers (the ``stream-rl plan`` options, one field each).
Produces: :class:`PlanInputs`, frozen, with the derived ``train_seq_len`` and ``use_master_weights``.
Guarantees: a :class:`PlanInputs` that exists is consistent: exactly one of the architecture and the parameter
count, a known dtype (:func:`~stream_rl.planner.memory.canonical_dtype`), fp32 master weights only for a 16-bit
dtype, no more trainer ranks than GPUs, every count within its bounds (at most :data:`MAX_GPUS` GPUs); any other
field is an error (``extra="forbid"``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stream_rl.planner import memory as mem
from stream_rl.planner.model_size import ModelShape

MAX_GPUS = 4096


class PlanInputs(BaseModel):
    """What the planner needs; sizes in sequences and tokens, memory in GiB."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelShape | None = Field(None, description="architecture (from config.json); None: use `params`")
    params: int | None = Field(None, ge=1, description="parameter count when no architecture is given")
    dtype: str = Field("bf16", description="training and inference dtype: fp32, bf16 or fp16")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="adamw: 2 fp32 moments; sgd: 1 (momentum)")
    master_weights: bool | None = Field(
        None, description="mixed precision as the trainer does it: fp32 parameters (the master weights), gradients "
                          "and optimizer state, 16-bit compute under autocast; False: pure 16-bit parameters and "
                          "gradients (a layout this repo's trainer does not have); None: yes for 16-bit dtypes")
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage; 0 replicates everything (plain DDP, "
                                                       "trainer.engine=torch)")
    gpus: int = Field(1, ge=1, le=MAX_GPUS, description="GPUs available")
    trainer_ranks: int | None = Field(
        None, ge=1, le=MAX_GPUS, description="data-parallel trainer ranks, one GPU each (stream-rl train --nproc); "
                                             "None: every GPU colocated, the fewest that fit separate")
    gpus_per_node: int = Field(8, ge=1, le=MAX_GPUS, description="GPUs per machine, for the trainer's launch line")
    gpu_memory_gib: float = Field(80.0, gt=0, description="memory of one GPU in GiB")
    micro_batch: int = Field(1, ge=1, description="trainer sequences per forward/backward, per GPU")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="trainer.max_tokens_per_micro_batch: micro batches filled by token count (at most "
                                "micro_batch sequences); None: micro_batch sequences of seq_len each")
    seq_len: int | None = Field(None, ge=1, description="trainer sequence length; None: prompt_len + max_new_tokens")
    gen_batch: int = Field(64, ge=1, description="sequences one generator holds at once")
    prompt_len: int = Field(512, ge=1, description="prompt tokens")
    max_new_tokens: int = Field(1024, ge=1, description="response token budget")
    grad_checkpointing: bool = Field(True, description="full per-layer activation recomputation")
    flash_attention: bool = Field(True, description="fused attention: no s^2 score tensors kept")
    reference: bool = Field(True, description="a frozen reference copy of the policy (KL)")
    reward_model_params: int = Field(0, ge=0, description="parameters of a reward model; 0: rule-based reward")
    headroom: float = Field(0.2, ge=0.0, lt=1.0, description="fraction added on top of every estimate")
    servers: int = Field(0, ge=0, le=MAX_GPUS, description="generate on this many inference servers "
                         "(producer.engine = 'server', [run.servers]), one GPU each, beside the trainer's and the "
                         "scorer's GPUs; 0: producers generate in-process")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        return mem.canonical_dtype(value)

    @model_validator(mode="after")
    def _consistent(self) -> PlanInputs:
        if (self.model is None) == (self.params is None):
            raise ValueError("give exactly one of the model's config (--config-json) and a parameter count (--params)")
        if self.master_weights and self.dtype == "fp32":
            raise ValueError("fp32 master weights only apply to a 16-bit dtype (--dtype bf16 or fp16)")
        if self.trainer_ranks is not None and self.trainer_ranks > self.gpus:
            raise ValueError(f"--trainer-ranks {self.trainer_ranks} is more than --gpus {self.gpus}: each trainer "
                             f"rank needs a GPU of its own")
        return self

    @property
    def train_seq_len(self) -> int:
        return self.seq_len if self.seq_len is not None else self.prompt_len + self.max_new_tokens

    @property
    def use_master_weights(self) -> bool:
        return self.master_weights if self.master_weights is not None else self.dtype != "fp32"

