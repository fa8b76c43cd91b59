"""The placement plan: per-GPU memory of each role, colocated vs separate, and a recommendation.

Consumes: :class:`PlanInputs` (the model as a :class:`~stream_rl.planner.model_size.ModelShape` or a parameter
count, dtypes, optimizer, ZeRO stage, GPUs, batch and generation sizes).
Produces: a :class:`Plan` with per-GPU byte breakdowns for the three roles (trainer: weights, gradients, optimizer,
activations, logits; generator: weights, KV cache; scorer: reference and reward weights) in two placements, and a
recommendation; :func:`render_table` prints it, :meth:`Plan.to_dict` serialises it.

Placements:
- **colocated**: every role on each of the N GPUs. The trainer is data parallel over N (ZeRO shards over N); each
  GPU also holds one generator (tensor parallel 1, ``gen_batch`` sequences) and the scorer's models.
- **separate**: each role on its own GPUs, each given the fewest that fit: the trainer the fewest data-parallel GPUs
  (only ZeRO >= 1 gains from more), the generator and the scorer the fewest power-of-two tensor-parallel degree
  (weights and KV cache split evenly).

A placement fits when each GPU's estimate plus the headroom (default 20 %) is at most the GPU's memory. We
recommend colocating when that fits, otherwise separate roles when their GPUs add up to at most N.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stream_rl.planner import memory as mem
from stream_rl.planner.model_size import ModelShape, count_params

MAX_GPUS = 4096


class PlanInputs(BaseModel):
    """What the planner needs; sizes in sequences and tokens, memory in GiB."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelShape | None = Field(None, description="architecture (from config.json); None: use `params`")
    params: int | None = Field(None, ge=1, description="parameter count when no architecture is given")
    dtype: str = Field("bf16", description="training and inference dtype: fp32, bf16 or fp16")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="adamw: 2 fp32 moments; sgd: 1 (momentum)")
    master_weights: bool | None = Field(None, description="fp32 master weights; None: yes for 16-bit dtypes")
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage; 0 replicates everything (plain DDP)")
    gpus: int = Field(1, ge=1, le=MAX_GPUS, description="GPUs available")
    gpu_memory_gib: float = Field(80.0, gt=0, description="memory of one GPU in GiB")
    micro_batch: int = Field(1, ge=1, description="trainer sequences per forward/backward, per GPU")
    seq_len: int | None = Field(None, ge=1, description="trainer sequence length; None: prompt_len + max_new_tokens")
    gen_batch: int = Field(64, ge=1, description="sequences one generator holds at once")
    prompt_len: int = Field(512, ge=1, description="prompt tokens")
    max_new_tokens: int = Field(1024, ge=1, description="response token budget")
    grad_checkpointing: bool = Field(True, description="full per-layer activation recomputation")
    flash_attention: bool = Field(True, description="fused attention: no s^2 score tensors kept")
    reference: bool = Field(True, description="a frozen reference copy of the policy (KL)")
    reward_model_params: int = Field(0, ge=0, description="parameters of a reward model; 0: rule-based reward")
    headroom: float = Field(0.2, ge=0.0, lt=1.0, description="fraction added on top of every estimate")

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
        return self

    @property
    def train_seq_len(self) -> int:
        return self.seq_len if self.seq_len is not None else self.prompt_len + self.max_new_tokens

    @property
    def use_master_weights(self) -> bool:
        return self.master_weights if self.master_weights is not None else self.dtype != "fp32"


@dataclass(frozen=True)
class RoleMemory:
    """One role's per-GPU memory: named components in bytes, on ``gpus`` GPUs (None: fits on no number)."""

    role: str
    gpus: int | None
    components: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(n for _, n in self.components)


@dataclass(frozen=True)
class Placement:
    """Roles and their per-GPU memory under one placement; ``per_gpu`` is the fullest GPU's estimate."""

    name: str
    roles: tuple[RoleMemory, ...]
    per_gpu: int
    needed_per_gpu: int  # per_gpu with headroom
    gpus: int | None
    fits: bool


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    params: int
    colocated: Placement
    separate: Placement
    recommendation: Literal["colocated", "separate", "does-not-fit"]
    message: str
    notes: tuple[str, ...]

    def to_dict(self) -> dict:
        def placement(p: Placement) -> dict:
            out = asdict(p)
            out["roles"] = [{"role": r.role, "gpus": r.gpus, "total_bytes": r.total,
                             "components": dict(r.components)} for r in p.roles]
            return out

        return {"inputs": self.inputs.model_dump(mode="json"), "params": self.params,
                "gpu_memory_bytes": _gpu_bytes(self.inputs), "colocated": placement(self.colocated),
                "separate": placement(self.separate), "recommendation": self.recommendation,
                "message": self.message, "notes": list(self.notes)}


def _gpu_bytes(inputs: PlanInputs) -> int:
    return int(inputs.gpu_memory_gib * mem.GIB)


def _fits(inputs: PlanInputs, per_gpu: int) -> bool:
    return mem.with_headroom(per_gpu, inputs.headroom) <= _gpu_bytes(inputs)


def trainer_memory(inputs: PlanInputs, params: int, gpus: int) -> RoleMemory:
    """The trainer's per-GPU bytes when data parallel over ``gpus`` with ZeRO ``inputs.zero_stage``."""
    stage, dtype = inputs.zero_stage, inputs.dtype
    parts = [("weights", mem.zero_shard_bytes(mem.weights_bytes(params, dtype), "weights", stage, gpus)),
             ("gradients", mem.zero_shard_bytes(mem.gradients_bytes(params, dtype), "gradients", stage, gpus)),
             ("optimizer", mem.zero_shard_bytes(
                 mem.optimizer_bytes(params, inputs.optimizer, inputs.use_master_weights), "optimizer", stage, gpus))]
    shape = inputs.model
    if shape is not None:
        s, b, h, e = inputs.train_seq_len, inputs.micro_batch, shape.hidden_size, mem.dtype_bytes(dtype)
        per_layer = mem.activation_bytes_per_layer(
            s, b, h, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.num_heads,
            shape.intermediate_size, gated=shape.gated_mlp, flash_attention=inputs.flash_attention, e=e)
        parts.append(("activations", mem.activations_bytes(shape.num_layers, per_layer, e * s * b * h,
                                                           inputs.grad_checkpointing)))
        parts.append(("logits", mem.logits_bytes(b, s, shape.vocab_size)))
    return RoleMemory("trainer", gpus, tuple(parts))


def generator_memory(inputs: PlanInputs, params: int, tp: int) -> RoleMemory:
    """One generator's per-GPU bytes at tensor-parallel degree ``tp``: (weights + KV cache) / tp."""
    parts = [("weights", -(-mem.weights_bytes(params, inputs.dtype) // tp))]
    shape = inputs.model
    if shape is not None:
        tokens = inputs.gen_batch * (inputs.prompt_len + inputs.max_new_tokens)
        kv = mem.kv_cache_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, mem.dtype_bytes(inputs.dtype),
                                tokens)
        parts.append(("kv_cache", -(-kv // tp)))
    return RoleMemory("generator", tp, tuple(parts))


def scorer_memory(inputs: PlanInputs, params: int, tp: int) -> RoleMemory:
    """The scorer's per-GPU bytes: (reference + reward weights, inference dtype) / tp; 0 GPUs when it has none."""
    ref = mem.weights_bytes(params, inputs.dtype) if inputs.reference else 0
    reward = mem.weights_bytes(inputs.reward_model_params, inputs.dtype)
    parts = (("reference", -(-ref // max(tp, 1))), ("reward_model", -(-reward // max(tp, 1))))
    return RoleMemory("scorer", tp if ref + reward else 0, parts)


def _colocated(inputs: PlanInputs, params: int) -> Placement:
    n = inputs.gpus
    roles = (trainer_memory(inputs, params, n), generator_memory(inputs, params, 1), scorer_memory(inputs, params, 1))
    roles = tuple(RoleMemory(r.role, n if r.gpus else 0, r.components) for r in roles)
    per_gpu = sum(r.total for r in roles)
    return Placement("colocated", roles, per_gpu, mem.with_headroom(per_gpu, inputs.headroom), n,
                     _fits(inputs, per_gpu))


def _fewest_trainer_gpus(inputs: PlanInputs, params: int) -> RoleMemory:
    """The trainer on the fewest GPUs that fit; stage 0 gains nothing from more, so it fits on 1 or never."""
    limit = 1 if inputs.zero_stage == 0 else MAX_GPUS
    for n in range(1, limit + 1):
        role = trainer_memory(inputs, params, n)
        if _fits(inputs, role.total):
            return role
    return RoleMemory("trainer", None, trainer_memory(inputs, params, inputs.gpus).components)


def _fewest_tp(inputs: PlanInputs, build) -> RoleMemory:
    """A generator or scorer at the smallest power-of-two tensor-parallel degree that fits."""
    tp = 1
    while tp <= MAX_GPUS:
        role = build(tp)
        if role.gpus == 0 or _fits(inputs, role.total):
            return role
        tp *= 2
    return RoleMemory(build(1).role, None, build(inputs.gpus).components)


def _separate(inputs: PlanInputs, params: int) -> Placement:
    roles = (_fewest_trainer_gpus(inputs, params),
             _fewest_tp(inputs, lambda tp: generator_memory(inputs, params, tp)),
             _fewest_tp(inputs, lambda tp: scorer_memory(inputs, params, tp)))
    per_gpu = max(r.total for r in roles)
    counts = [r.gpus for r in roles]
    gpus = None if None in counts else sum(counts)
    fits = gpus is not None and gpus <= inputs.gpus
    return Placement("separate", roles, per_gpu, mem.with_headroom(per_gpu, inputs.headroom), gpus, fits)


def _recommend(inputs: PlanInputs, colocated: Placement, separate: Placement) -> tuple[str, str]:
    gib, cap = mem.gib, inputs.gpu_memory_gib
    if colocated.fits:
        return "colocated", (f"colocate: every role on each of the {inputs.gpus} GPU(s), "
                             f"{gib(colocated.needed_per_gpu):.1f} GiB needed of {cap:g} GiB")
    counts = ", ".join(f"{r.role} {r.gpus if r.gpus is not None else 'none fit'}" for r in separate.roles)
    if separate.fits:
        spare = inputs.gpus - separate.gpus
        extra = f"; {spare} spare (more generator replicas)" if spare else ""
        return "separate", f"separate roles on {separate.gpus} of {inputs.gpus} GPU(s): {counts}{extra}"
    if separate.gpus is not None:
        return "does-not-fit", (f"separate roles need {separate.gpus} GPU(s) ({counts}); only {inputs.gpus} "
                                f"available")
    return "does-not-fit", (f"no placement fits ({counts}): try a higher --zero-stage, --grad-checkpointing, a "
                            f"smaller --micro-batch/--seq-len or --gen-batch, or larger GPUs")


def _notes(inputs: PlanInputs, colocated: Placement) -> tuple[str, ...]:
    notes = ["not counted: CUDA context and allocator fragmentation (the headroom is for them), the scorer's and "
             "generator's forward activations, CUDA graphs"]
    if inputs.model is None:
        notes.append("activations, logits and KV cache need the architecture (--config-json): left out, so the "
                     "totals are lower bounds")
    generator = next(r for r in colocated.roles if r.role == "generator")
    share = mem.with_headroom(generator.total, inputs.headroom) / _gpu_bytes(inputs)
    notes.append(f"vLLM preallocates gpu_memory_utilization of the GPU: colocated, the generator needs about "
                 f"{share:.2f} (producer.vllm.gpu_memory_utilization)")
    return tuple(notes)


def make_plan(inputs: PlanInputs) -> Plan:
    """Estimate every role's per-GPU memory in both placements and recommend one (module doc)."""
    params = count_params(inputs.model) if inputs.model is not None else inputs.params
    colocated, separate = _colocated(inputs, params), _separate(inputs, params)
    recommendation, message = _recommend(inputs, colocated, separate)
    return Plan(inputs, params, colocated, separate, recommendation, message, _notes(inputs, colocated))


def _role_rows(colocated: RoleMemory, separate: RoleMemory) -> list[tuple[str, str, str, str]]:
    gpus = "-" if separate.gpus is None else str(separate.gpus)
    rows = [(colocated.role, "GPUs", str(colocated.gpus), gpus)]
    sep = dict(separate.components)
    rows += [("", name, f"{mem.gib(n):.2f}", f"{mem.gib(sep[name]):.2f}") for name, n in colocated.components]
    rows.append(("", "total", f"{mem.gib(colocated.total):.2f}", f"{mem.gib(separate.total):.2f}"))
    return rows


def render_table(plan: Plan) -> str:
    """A plain-text table of per-GPU GiB per role and component, colocated vs separate, and the recommendation."""
    i = plan.inputs
    master = " + fp32 master" if i.use_master_weights else ""
    head = (f"{plan.params / 1e9:.3f} B parameters, {i.dtype}, {i.optimizer}{master}, ZeRO {i.zero_stage}, "
            f"{i.gpus} x {i.gpu_memory_gib:g} GiB, headroom {i.headroom:.0%}")
    rows = [("role", "component", "colocated GiB/GPU", "separate GiB/GPU")]
    for c, s in zip(plan.colocated.roles, plan.separate.roles):
        rows += _role_rows(c, s)
    co, se = plan.colocated, plan.separate
    rows.append(("all", "per GPU + headroom", f"{mem.gib(co.needed_per_gpu):.2f}", f"{mem.gib(se.needed_per_gpu):.2f}"))
    rows.append(("all", "fits", "yes" if co.fits else "no", "yes" if se.fits else "no"))
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    lines = [head, ""] + ["  ".join(r[k].ljust(widths[k]) if k < 2 else r[k].rjust(widths[k]) for k in range(4))
                          for r in rows]
    lines += ["", f"recommendation: {plan.message}"] + [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
