"""Which GPUs each role of `stream-rl run` sees, and how much of each GPU it may take.

Consumes: ``run.gpus`` (:class:`GpuLayout`: device lists per role such as ``producers = "0-5"``, ``trainer =
"6-7"``, ``scorers = "6"``, the GPU count when known, the trainer's and scorer's memory shares) and the counts and
shares the other sections fix (``run.producers``, ``run.scorers``, ``run.trainer_ranks``,
``producer.vllm.tensor_parallel_size`` and ``producer.vllm.gpu_memory_utilization``) as a :class:`RoleCounts`.
Produces: :func:`assign`, the ``CUDA_VISIBLE_DEVICES`` of every role process (``produce-0``, ``train-0``, ...);
:func:`layout_errors`, every broken rule as ``(fields, message)``; :func:`describe`, the layout as lines for
``stream-rl run --dry-run``.
Guarantees: pure (no torch, no CUDA call; the GPU count at run time is passed in by the caller). The device lists
are indexes of the GPUs this machine shows the ``stream-rl run`` process: when ``CUDA_VISIBLE_DEVICES`` is already
set for it, index ``i`` is its ``i``-th entry (:func:`visible_devices`), as CUDA itself numbers them.

Rules (each refused naming its fields):
- an index must exist: ``0 <= i < count`` (``run.gpus.count``, else the count torch reports when the run starts);
- the producers' GPUs are split into blocks of ``tensor_parallel_size``, one block per producer (data parallelism
  by more producers), used round-robin when there are more producers than blocks; the list must hold a whole
  number of blocks, at least one (or none at all: ``""``, no producer sees a GPU);
- each trainer rank needs a GPU of its own: ``run.trainer_ranks <= len(trainer GPUs)`` (``""``: CPU ranks);
- an inference server's GPUs (``run.servers.gpus``, ``producer.engine = "server"``) must exist too;
- per GPU, the shares of every process on it (a producer's ``gpu_memory_utilization`` on each GPU of its block, a
  trainer rank's ``trainer_memory``, each scorer's ``scorer_memory``, the evaluator's ``evaluator_memory``, each
  inference server's ``--gpu-memory-utilization`` from ``run.servers.extra_args``, vLLM's 0.9 when unset) satisfy
  ``sum(shares) * (1 + headroom) <= 1``: the planner's 20 % headroom (``docs/planner.md``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import Field, field_validator

from stream_rl.config.base import Section

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
MAX_GPUS = 4096


def parse_devices(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``; ``""`` or ``"none"`` -> ``()`` (the role sees no GPU). Raises ValueError
    naming the bad part: an item that is not ``N`` or ``N-M``, a range running backwards, a repeated index."""
    if text.strip().lower() in ("", "none"):
        return ()
    out: list[int] = []
    for part in text.split(","):
        match = _RANGE.match(part)
        if match is None:
            raise ValueError(f"{part.strip()!r} is not a GPU index or range (write e.g. \"0-5\" or \"0,2,3\")")
        low, high = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if high < low:
            raise ValueError(f"range {part.strip()!r} runs backwards")
        out.extend(range(low, high + 1))
    repeated = sorted({i for i in out if out.count(i) > 1})
    if repeated:
        raise ValueError(f"GPU {repeated[0]} is listed twice")
    return tuple(out)


class GpuLayout(Section):
    """`stream-rl run`: the GPUs of each role (``CUDA_VISIBLE_DEVICES`` of its processes) and their memory shares."""

    count: int | None = Field(None, ge=1, le=MAX_GPUS, description="GPUs on this machine; None: asked of torch "
                              "when the run starts (then an index that does not exist is refused at launch, "
                              "not by --dry-run)")
    producers: str | None = Field(None, description="GPU indexes of the producers, e.g. \"0-5\": split into blocks "
                                  "of producer.vllm.tensor_parallel_size, one block per producer; None: the "
                                  "environment's CUDA_VISIBLE_DEVICES is left as it is")
    trainer: str | None = Field(None, description="GPU indexes of the trainer, one per rank (run.trainer_ranks), "
                                "e.g. \"6-7\"; None: left as it is")
    scorers: str | None = Field(None, description="GPU indexes every scorer sees, e.g. \"6\"; None: left as it is")
    evaluator: str | None = Field(None, description="GPU indexes the evaluator sees; None: left as it is")
    producer_memory: float = Field(0.0, ge=0.0, le=1.0, description="share of a GPU one producer takes with "
                                   "producer.engine = \"hf\" (vllm: producer.vllm.gpu_memory_utilization)")
    trainer_memory: float = Field(0.0, ge=0.0, le=1.0, description="share of its GPU one trainer rank takes "
                                  "(`stream-rl plan` proposes it); 0: not checked")
    scorer_memory: float = Field(0.0, ge=0.0, le=1.0, description="share of a GPU one scorer takes; 0: not checked")
    evaluator_memory: float = Field(0.0, ge=0.0, le=1.0, description="share of a GPU the evaluator takes")
    headroom: float = Field(0.2, ge=0.0, lt=1.0, description="kept free on every GPU: the shares on a GPU must "
                            "satisfy sum * (1 + headroom) <= 1")

    @field_validator("producers", "trainer", "scorers", "evaluator", mode="before")
    @classmethod
    def _devices(cls, value: object) -> object:
        """One index may come as a number (``scorers = 6``, ``--set run.gpus.scorers=6``); checked by
        :func:`parse_devices`."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str):
            parse_devices(value)
        return value

    def devices(self, role: str) -> tuple[int, ...] | None:
        """The parsed list of ``role`` (a field name), None when unset."""
        value = getattr(self, role)
        return None if value is None else parse_devices(value)


@dataclass(frozen=True)
class RoleCounts:
    """What the other sections fix: processes per role, the producers' tensor-parallel size and vLLM share."""

    producers: int
    scorers: int
    trainer_ranks: int
    evaluator: bool
    tensor_parallel_size: int = 1
    producer_share: float | None = None  # producer.vllm.gpu_memory_utilization; None: run.gpus.producer_memory
    producer_share_field: str = "producer.vllm.gpu_memory_utilization"
    servers: tuple[tuple[int, ...], ...] = ()  # each inference server's GPUs (run.servers.gpus)
    server_share: float = 0.0  # each server's --gpu-memory-utilization (run.servers.extra_args)


def producer_blocks(layout: GpuLayout, counts: RoleCounts) -> list[tuple[int, ...]] | None:
    """One GPU block per producer (round-robin over ``len(gpus) // tp`` blocks); None when unset or invalid."""
    gpus, tp = layout.devices("producers"), counts.tensor_parallel_size
    if gpus == ():  # "": every producer sees no GPU
        return [() for _ in range(counts.producers)]
    if gpus is None or len(gpus) % tp:
        return None
    blocks = [gpus[i:i + tp] for i in range(0, len(gpus), tp)]
    return [blocks[i % len(blocks)] for i in range(counts.producers)]


def assign(layout: GpuLayout, counts: RoleCounts) -> dict[str, tuple[int, ...]]:
    """Process name (``produce-0``, ``score-1``, ``train-0``, ``evaluate-0``) -> the GPU indexes it sees; a process
    whose role has no list is absent (its environment is left as it is)."""
    out: dict[str, tuple[int, ...]] = {}
    for i, block in enumerate(producer_blocks(layout, counts) or []):
        out[f"produce-{i}"] = block
    for role, name, n in (("scorers", "score", counts.scorers), ("trainer", "train", 1),
                          ("evaluator", "evaluate", int(counts.evaluator))):
        gpus = layout.devices(role)
        if gpus is not None:
            out.update({f"{name}-{i}": gpus for i in range(n)})
    return out


def visible_devices(gpus: tuple[int, ...], parent: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a process that should see ``gpus``: indexes into the parent's own
    ``CUDA_VISIBLE_DEVICES`` when it has one (``"2,3"`` and gpus ``(1,)`` -> ``"3"``), else the indexes."""
    ids = [x.strip() for x in parent.split(",")] if parent not in (None, "") else None
    return ",".join(ids[i] if ids is not None else str(i) for i in gpus)


def _shares(layout: GpuLayout, counts: RoleCounts, table: dict[str, tuple[int, ...]]) -> dict[int, list]:
    """GPU -> [(field, share)] of every process on it."""
    producer = (counts.producer_share, counts.producer_share_field) if counts.producer_share is not None else (
        layout.producer_memory, "run.gpus.producer_memory")
    field_of = {"produce": (producer[1], producer[0]), "score": ("run.gpus.scorer_memory", layout.scorer_memory),
                "evaluate": ("run.gpus.evaluator_memory", layout.evaluator_memory)}
    per_gpu: dict[int, list] = {}
    for process, gpus in table.items():
        role = process.rsplit("-", 1)[0]
        if role == "train":  # one rank per GPU
            ranks = gpus[:counts.trainer_ranks]
            for gpu in ranks:
                per_gpu.setdefault(gpu, []).append(("run.gpus.trainer_memory", layout.trainer_memory))
            continue
        for gpu in gpus:
            per_gpu.setdefault(gpu, []).append(field_of[role])
    for gpus in counts.servers:  # an inference server holds its share on each GPU it sees (tensor parallel)
        for gpu in gpus:
            per_gpu.setdefault(gpu, []).append(("run.servers.gpus", counts.server_share))
    return per_gpu


def layout_errors(layout: GpuLayout, counts: RoleCounts, count: int | None = None) -> list[tuple[tuple[str, ...], str]]:
    """Every broken rule of the module docstring as ``(fields, message)``; ``count``: the GPUs known to exist
    (``layout.count`` when None; no index check when both are None)."""
    errors: list[tuple[tuple[str, ...], str]] = []
    known = count if count is not None else layout.count
    source = "run.gpus.count" if count is None else "torch"
    lists = [(f"run.gpus.{role}", layout.devices(role)) for role in ("producers", "trainer", "scorers", "evaluator")]
    lists += [("run.servers.gpus", gpus) for gpus in counts.servers]
    for field, gpus in lists:
        missing = [i for i in gpus or () if known is not None and i >= known]
        if missing:
            fields = (field,) + (("run.gpus.count",) if count is None else ())
            indexes = f"indexes 0-{known - 1}" if known else "no GPU"
            errors.append((fields, f"{field}: GPU {missing[0]} does not exist: {source} says {known} "
                                   f"GPU(s), {indexes}"))
    producers, tp = layout.devices("producers"), counts.tensor_parallel_size
    if producers and (len(producers) < tp or len(producers) % tp):
        errors.append((("producer.vllm.tensor_parallel_size", "run.gpus.producers"), (
            f"producer.vllm.tensor_parallel_size={tp} does not divide the {len(producers)} GPU(s) of "
            f"run.gpus.producers={layout.producers!r}: each producer needs a block of {tp} GPU(s)")))
    trainer = layout.devices("trainer")
    if trainer and counts.trainer_ranks > len(trainer):  # "": the ranks see no GPU (CPU ranks)
        errors.append((("run.trainer_ranks", "run.gpus.trainer"), (
            f"run.trainer_ranks={counts.trainer_ranks} > the {len(trainer)} GPU(s) of run.gpus.trainer="
            f"{layout.trainer!r}: each trainer rank needs a GPU of its own")))
    for gpu, shares in sorted(_shares(layout, counts, assign(layout, counts)).items()):
        total = sum(s for _, s in shares)
        if total * (1 + layout.headroom) > 1 + 1e-9:
            fields = tuple(dict.fromkeys(f for f, _ in shares))
            terms = " + ".join(f"{f}={s:g}" for f, s in shares)
            errors.append((fields + ("run.gpus.headroom",), (
                f"GPU {gpu}: {terms} = {total:.3g} of the GPU, {total * (1 + layout.headroom):.3g} with "
                f"run.gpus.headroom={layout.headroom:g}: more than the GPU has; lower the shares (stream-rl plan "
                f"proposes them)")))
    return errors


def describe(layout: GpuLayout | None, counts: RoleCounts) -> list[str]:
    """The layout as lines: each process and its GPUs, each GPU's summed share."""
    if layout is None:
        return ["gpus: no run.gpus layout: every role sees the GPUs of the environment (CUDA_VISIBLE_DEVICES)"]
    table = assign(layout, counts)
    count = f"{layout.count} GPU(s)" if layout.count is not None else "GPU count from torch at launch"
    lines = [f"gpus ({count}):"]
    lines += [f"  {process}: CUDA_VISIBLE_DEVICES={','.join(map(str, gpus)) or '(none)'}"
              for process, gpus in table.items()]
    lines += [f"  server-{i}: CUDA_VISIBLE_DEVICES={','.join(map(str, gpus)) or '(none)'} (run.servers.gpus)"
              for i, gpus in enumerate(counts.servers)]
    for gpu, shares in sorted(_shares(layout, counts, table).items()):
        total = sum(s for _, s in shares)
        lines.append(f"  GPU {gpu}: memory share {total:.3g} ({total * (1 + layout.headroom):.3g} with headroom)")
    return lines
