"""The placement plan: per-GPU memory of each role, colocated vs separate, a recommendation and the trainer's launch.

Consumes: :class:`~stream_rl.planner.inputs.PlanInputs` (the model as a
:class:`~stream_rl.planner.model_size.ModelShape` or a parameter count, dtypes, optimizer, ZeRO stage, GPUs,
trainer ranks, batch and generation sizes).
Produces: a :class:`Plan` with per-GPU byte breakdowns for the three roles (trainer: weights, autocast copy,
gradients, optimizer, master copy, all-reduce buffer, activations, logits; generator: weights, KV cache; scorer:
reference and reward weights) in two placements, a recommendation and, for it, the ``stream-rl train`` line
(:class:`TrainerLaunch`); :func:`stream_rl.planner.render.render_table` prints it, :meth:`Plan.to_dict` serialises it.

Placements:
- **colocated**: every role on each of the G GPUs. The trainer is data parallel over G ranks (ZeRO shards over G);
  each GPU also holds one generator (tensor parallel 1, ``gen_batch`` sequences) and the scorer's models. With
  ``trainer_ranks`` set to anything but G it does not apply (:data:`Placement.reason` says why).
- **separate**: each role on its own GPUs: the trainer on ``trainer_ranks`` data-parallel GPUs, or when that is
  None the fewest that fit (only ZeRO >= 1 gains from more); the generator and the scorer on one GPU each (none
  for a scorer without models); with ``servers`` N, the generator is N inference servers on a GPU each
  (``producer.engine = "server"``), and colocation does not apply.

Only layouts this project runs are planned: the trainer's data-parallel ranks (torch, DDP-style, at ZeRO 0;
DeepSpeed ZeRO 1/2/3 over N ranks; ``consumers/trainer/engines.py``, ``ranks.py``). There is no tensor or pipeline
parallelism anywhere (trainer, generator or scorer), so a generator or scorer that does not fit one GPU fits on no
number of them.

A placement fits when each GPU's estimate plus the headroom (default 20 %) is at most the GPU's memory, and
:func:`verdict` says why it fits or not (``fits: 12.3 GiB of 80 GiB per GPU``). We recommend colocating when that
fits, otherwise separate roles when they fit and their GPUs add up to at most G.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from stream_rl.planner import memory as mem
from stream_rl.planner.inputs import MAX_GPUS, PlanInputs
from stream_rl.planner.model_size import count_params
from stream_rl.planner.units import human_bytes, human_gib

ENGINE_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}  # planner dtype -> trainer.dtype (the trainer has no fp16)


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
    """Roles and their per-GPU memory under one placement; ``per_gpu`` is the fullest GPU's estimate.

    ``reason`` is set when the placement does not apply to the inputs (then ``roles`` is empty and ``fits`` False).
    """

    name: str
    roles: tuple[RoleMemory, ...]
    per_gpu: int
    needed_per_gpu: int  # per_gpu with headroom
    gpus: int | None
    fits: bool
    reason: str | None = None

    @property
    def trainer_ranks(self) -> int | None:
        return next((r.gpus for r in self.roles if r.role == "trainer"), None)


@dataclass(frozen=True)
class TrainerLaunch:
    """The ``stream-rl train`` line for ``ranks`` data-parallel ranks: ``nnodes`` machines of ``nproc_per_node``."""

    ranks: int
    nnodes: int
    nproc_per_node: int
    zero_stage: int
    trainer_dtype: str | None  # trainer.dtype; None: the planned dtype is not one the trainer has (fp16, pure 16-bit)

    @property
    def settings(self) -> tuple[str, ...]:
        engine = (("trainer.engine=torch",) if self.zero_stage == 0 else
                  ("trainer.engine=deepspeed", f"trainer.zero_stage={self.zero_stage}"))
        return engine + ((f"trainer.dtype={self.trainer_dtype}",) if self.trainer_dtype else ())

    @property
    def command(self) -> str:
        nodes = f" --nnodes {self.nnodes} --rdzv-endpoint HOST:PORT" if self.nnodes > 1 else ""
        sets = "".join(f" --set {s}" for s in self.settings)
        return f"stream-rl train --nproc {self.nproc_per_node}{nodes}{sets}"


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    params: int
    colocated: Placement
    separate: Placement
    recommendation: Literal["colocated", "separate", "does-not-fit"]
    message: str
    notes: tuple[str, ...]
    trainer_launch: TrainerLaunch | None = None  # for the recommended placement; None when nothing fits

    def to_dict(self) -> dict:
        def placement(p: Placement) -> dict:
            out = asdict(p)
            out["trainer_ranks"] = p.trainer_ranks
            out["verdict"] = verdict(self.inputs, p)
            out["roles"] = [{"role": r.role, "gpus": r.gpus, "total_bytes": r.total,
                             "components": dict(r.components)} for r in p.roles]
            return out

        launch = self.trainer_launch
        return {"inputs": self.inputs.model_dump(mode="json"), "params": self.params,
                "gpu_memory_bytes": _gpu_bytes(self.inputs), "colocated": placement(self.colocated),
                "separate": placement(self.separate), "recommendation": self.recommendation,
                "message": self.message,
                "trainer_launch": None if launch is None else {**asdict(launch), "settings": list(launch.settings),
                                                               "command": launch.command},
                "notes": list(self.notes)}


def _gpu_bytes(inputs: PlanInputs) -> int:
    return int(inputs.gpu_memory_gib * mem.GIB)


def _fits(inputs: PlanInputs, per_gpu: int) -> bool:
    return mem.with_headroom(per_gpu, inputs.headroom) <= _gpu_bytes(inputs)


def trainer_memory(inputs: PlanInputs, params: int, gpus: int) -> RoleMemory:
    """The trainer's per-GPU bytes when data parallel over ``gpus`` ranks with ZeRO ``inputs.zero_stage``.

    Components (``docs/planner.md``): weights and gradients in the trained parameters' dtype (fp32 under mixed
    precision), autocast's 16-bit weight copies, optimizer moments, DeepSpeed's fp32 master copy (stages 1-3),
    each sharded from its ZeRO stage; with the architecture, activations and logits; and ``allreduce``, what the
    torch engine's flat gradient buffer (stage 0, several ranks) adds at the step beyond the autocast copies,
    activations and logits that backward has freed by then, so the total is the larger of the two peaks.
    """
    stage, dtype = inputs.zero_stage, inputs.dtype
    param_dtype = mem.trained_param_dtype(dtype, inputs.use_master_weights)
    gradients = mem.gradients_bytes(params, param_dtype)
    autocast = mem.autocast_copy_bytes(params, dtype, inputs.use_master_weights)
    parts = [("weights", mem.zero_shard_bytes(mem.weights_bytes(params, param_dtype), "weights", stage, gpus)),
             ("autocast_copy", autocast),
             ("gradients", mem.zero_shard_bytes(gradients, "gradients", stage, gpus)),
             ("optimizer", mem.zero_shard_bytes(mem.optimizer_bytes(params, inputs.optimizer), "optimizer", stage,
                                                gpus)),
             ("master_copy", mem.zero_shard_bytes(mem.zero_master_copy_bytes(params, stage), "master_copy", stage,
                                                  gpus))]
    shape = inputs.model
    if shape is not None:
        s, h, e = inputs.train_seq_len, shape.hidden_size, mem.dtype_bytes(dtype)
        b = mem.micro_batch_rows(s, inputs.micro_batch, inputs.micro_batch_tokens)
        per_layer = mem.activation_bytes_per_layer(
            s, b, h, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.num_heads,
            shape.intermediate_size, gated=shape.gated_mlp, flash_attention=inputs.flash_attention, e=e)
        transient = [("activations", mem.activations_bytes(shape.num_layers, per_layer, e * s * b * h,
                                                            inputs.grad_checkpointing)),
                     ("logits", mem.logits_bytes(b, s, shape.vocab_size))]
    else:
        transient = []
    freed = autocast + sum(n for _, n in transient)  # alive through backward, gone by the step
    allreduce = max(0, mem.flat_allreduce_bytes(gradients, stage, gpus) - freed)
    return RoleMemory("trainer", gpus, tuple(parts + [("allreduce", allreduce)] + transient))


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
    if inputs.servers:
        return Placement("colocated", (), 0, 0, None, False, (
            f"--servers {inputs.servers}: each inference server takes a GPU of its own"))
    if inputs.trainer_ranks is not None and inputs.trainer_ranks != n:
        reason = (f"colocation puts a trainer rank on every GPU, and --trainer-ranks {inputs.trainer_ranks} is "
                  f"not --gpus {n}")
        return Placement("colocated", (), 0, 0, None, False, reason)
    roles = (trainer_memory(inputs, params, n), generator_memory(inputs, params, 1), scorer_memory(inputs, params, 1))
    roles = tuple(RoleMemory(r.role, n if r.gpus else 0, r.components) for r in roles)
    per_gpu = sum(r.total for r in roles)
    return Placement("colocated", roles, per_gpu, mem.with_headroom(per_gpu, inputs.headroom), n,
                     _fits(inputs, per_gpu))


def _separate_trainer(inputs: PlanInputs, params: int) -> RoleMemory:
    """The trainer on ``--trainer-ranks`` GPUs, or on the fewest that fit (``gpus`` None: no number fits).

    Stage 0 replicates everything (and adds the all-reduce buffer above one rank), so it fits on 1 or never.
    """
    if inputs.trainer_ranks is not None:
        return trainer_memory(inputs, params, inputs.trainer_ranks)
    limit = 1 if inputs.zero_stage == 0 else MAX_GPUS
    for n in range(1, limit + 1):
        role = trainer_memory(inputs, params, n)
        if _fits(inputs, role.total):
            return role
    return RoleMemory("trainer", None, trainer_memory(inputs, params, inputs.gpus).components)


def _one_gpu(inputs: PlanInputs, role: RoleMemory) -> RoleMemory:
    """A generator or scorer on one GPU (no tensor parallelism here): ``gpus`` None when it does not fit one."""
    return role if role.gpus == 0 or _fits(inputs, role.total) else RoleMemory(role.role, None, role.components)


def _separate(inputs: PlanInputs, params: int) -> Placement:
    generator = _one_gpu(inputs, generator_memory(inputs, params, 1))
    if inputs.servers and generator.gpus is not None:  # one inference server per GPU
        generator = RoleMemory(generator.role, inputs.servers, generator.components)
    roles = (_separate_trainer(inputs, params), generator, _one_gpu(inputs, scorer_memory(inputs, params, 1)))
    per_gpu = max(r.total for r in roles)
    counts = [r.gpus for r in roles]
    gpus = None if None in counts else sum(counts)
    fits = gpus is not None and gpus <= inputs.gpus and _fits(inputs, per_gpu)
    return Placement("separate", roles, per_gpu, mem.with_headroom(per_gpu, inputs.headroom), gpus, fits)


def _recommend(inputs: PlanInputs, colocated: Placement, separate: Placement) -> tuple[str, str]:
    cap = inputs.gpu_memory_gib
    if colocated.fits:
        return "colocated", (f"colocate: every role on each of the {inputs.gpus} GPU(s), "
                             f"{human_bytes(colocated.needed_per_gpu)} needed of {human_gib(cap)}")
    counts = ", ".join(f"{r.role} {r.gpus if r.gpus is not None else 'none fit'}" for r in separate.roles)
    if separate.fits:
        spare = inputs.gpus - separate.gpus
        more = "more --servers" if inputs.servers else "more generator replicas"
        extra = f"; {spare} spare ({more})" if spare else ""
        return "separate", f"separate roles on {separate.gpus} of {inputs.gpus} GPU(s): {counts}{extra}"
    trainer = separate.roles[0]
    if inputs.trainer_ranks is not None and not _fits(inputs, trainer.total):
        return "does-not-fit", (f"the trainer on --trainer-ranks {inputs.trainer_ranks} needs "
                                f"{human_bytes(mem.with_headroom(trainer.total, inputs.headroom))} per GPU of "
                                f"{human_gib(cap)}: try more --trainer-ranks, a higher --zero-stage, a smaller "
                                f"--micro-batch/--seq-len, or larger GPUs")
    if separate.gpus is not None:
        return "does-not-fit", (f"separate roles need {separate.gpus} GPU(s) ({counts}); only {inputs.gpus} "
                                f"available")
    return "does-not-fit", (f"no placement fits ({counts}): try a higher --zero-stage, --grad-checkpointing, a "
                            f"smaller --micro-batch/--seq-len or --gen-batch, or larger GPUs (the generator and "
                            f"the scorer must each fit one GPU: there is no tensor parallelism)")


def _where(inputs: PlanInputs, role: str) -> str:
    if role != "trainer":
        return "on one GPU (no tensor parallelism)"
    if inputs.zero_stage == 0:
        return "per GPU (ZeRO 0 keeps everything on every rank)"
    return f"per GPU even over {inputs.gpus} data-parallel ranks"


def verdict(inputs: PlanInputs, p: Placement) -> str:
    """Why ``p`` fits or not, in figures: ``fits: 12.3 GiB of 80 GiB per GPU (7 of 8 GPUs)``, ``does not fit:
    needs 95 GiB per GPU, has 80 GiB``, ``does not fit: needs 9 GPUs, has 8``, or the reason it does not apply."""
    if p.reason is not None:
        return f"not applicable: {p.reason}"
    has = human_gib(inputs.gpu_memory_gib)
    gpus = f" ({p.gpus} of {inputs.gpus} GPUs)" if p.gpus is not None else ""
    if p.fits:
        return f"fits: {human_bytes(p.needed_per_gpu)} of {has} per GPU{gpus}, headroom included"
    too_big = [r for r in p.roles if r.gpus is None]
    if too_big:
        needs = ", ".join(f"the {r.role} needs {human_bytes(mem.with_headroom(r.total, inputs.headroom))} "
                          f"{_where(inputs, r.role)}" for r in too_big)
        return f"does not fit: {needs}; has {has}"
    if not _fits(inputs, p.per_gpu):
        return f"does not fit: needs {human_bytes(p.needed_per_gpu)} per GPU, has {has} (headroom included)"
    return f"does not fit: needs {p.gpus} GPUs, has {inputs.gpus}"


def trainer_launch(inputs: PlanInputs, ranks: int) -> TrainerLaunch:
    """``ranks`` data-parallel ranks as ``stream-rl train`` runs them: on one machine when they fit one (at most
    ``gpus_per_node``), else on M machines of ``ranks / M`` each, M the smallest divisor of ``ranks`` that is at
    least ``ceil(ranks / gpus_per_node)`` (torchrun starts the same number of ranks on every machine)."""
    nnodes = -(-ranks // inputs.gpus_per_node)
    while ranks % nnodes:
        nnodes += 1
    trainer_dtype = ENGINE_DTYPE.get(inputs.dtype) if inputs.use_master_weights or inputs.dtype == "fp32" else None
    return TrainerLaunch(ranks, nnodes, ranks // nnodes, inputs.zero_stage, trainer_dtype)


def _notes(inputs: PlanInputs, params: int, launch: TrainerLaunch | None) -> tuple[str, ...]:
    notes = ["not counted: CUDA context and allocator fragmentation (the headroom is for them), the scorer's and "
             "generator's forward activations, CUDA graphs, ZeRO's communication buckets"]
    if inputs.model is None:
        notes.append("activations, logits and KV cache need the architecture (--config-json): left out, so the "
                     "totals are lower bounds")
    if inputs.grad_checkpointing and inputs.model is not None:
        notes.append("activations assume gradient checkpointing: train with trainer.gradient_checkpointing=true "
                     "(and trainer.share_prompts=false), or plan without it (--no-grad-checkpointing)")
    if launch is not None and launch.trainer_dtype is None:
        notes.append(f"the trainer trains in float32 or bfloat16 with fp32 master weights only: this plan's "
                     f"{inputs.dtype}{'' if inputs.use_master_weights else ' without master weights'} layout "
                     f"has no trainer.dtype, so the launch line leaves it out")
    if launch is not None and launch.nnodes > 1 and launch.nproc_per_node < inputs.gpus_per_node:
        notes.append(f"{launch.ranks} ranks do not divide into machines of {inputs.gpus_per_node} GPUs: "
                     f"{launch.nproc_per_node} per machine on {launch.nnodes} machines")
    generator = generator_memory(inputs, params, 1)
    share = mem.with_headroom(generator.total, inputs.headroom) / _gpu_bytes(inputs)
    if inputs.servers:
        notes.append(f"each inference server has its GPU alone: the layout gives it all but the headroom as "
                     f"--gpu-memory-utilization (the rest is KV cache); it needs at least {max(share, 0.01):.2f}. "
                     f"Servers on other machines: start them there and list their URLs in producer.server.urls")
    else:
        notes.append(f"vLLM preallocates gpu_memory_utilization of the GPU: colocated, the generator needs about "
                     f"{max(share, 0.01):.2f} (producer.vllm.gpu_memory_utilization)")
    return tuple(notes)


def make_plan(inputs: PlanInputs) -> Plan:
    """Estimate every role's per-GPU memory in both placements, recommend one and give its trainer launch line."""
    params = count_params(inputs.model) if inputs.model is not None else inputs.params
    colocated, separate = _colocated(inputs, params), _separate(inputs, params)
    recommendation, message = _recommend(inputs, colocated, separate)
    chosen = {"colocated": colocated, "separate": separate}.get(recommendation)
    launch = trainer_launch(inputs, chosen.trainer_ranks) if chosen is not None else None
    return Plan(inputs, params, colocated, separate, recommendation, message, _notes(inputs, params, launch), launch)
