"""The ``stream-rl run`` GPU layout a plan proposes: ``run.gpus`` device lists and memory shares, the role counts,
and vLLM's ``gpu_memory_utilization``.

Consumes: a :class:`~stream_rl.planner.plan.Plan` (its recommendation and per-role bytes).
Produces: :func:`propose_layout`, a nested dict of config settings (``{"run": {...}, "producer": {"vllm":
{...}}}``) or None when nothing fits; :func:`layout_toml`, the same as TOML lines to paste into a config.
Guarantees: pure. A role's share of a GPU is its per-GPU estimate over the GPU's memory, rounded UP to the next
hundredth: ``share = ceil(100 * bytes / gpu_bytes) / 100``; the run's check (:mod:`stream_rl.launch.gpus`) then
adds the headroom to the sum of the shares on each GPU, as the plan does to the sum of the bytes.

Layouts:
- **colocated** on G GPUs: the trainer's G ranks on ``0-(G-1)``, one producer per GPU (``run.producers = G``,
  tensor parallel 1), one scorer on GPU 0 (none: ``scorers = ""`` when it has no model);
- **separate**: the trainer's T ranks on ``0-(T-1)``, the scorer on GPU T when it has a model, one producer on
  each GPU left (``run.producers`` = their count).
"""

from __future__ import annotations

import math

from stream_rl.planner.plan import Plan


def share(nbytes: int, gpu_bytes: int) -> float:
    """``ceil(100 * nbytes / gpu_bytes) / 100``, at least 0.01 for a role that holds anything."""
    if nbytes <= 0:
        return 0.0
    return max(0.01, math.ceil(100 * nbytes / gpu_bytes - 1e-9) / 100)


def _span(first: int, n: int) -> str:
    return str(first) if n == 1 else f"{first}-{first + n - 1}"


def propose_layout(plan: Plan) -> dict | None:
    """The recommended placement as ``stream-rl run`` settings (module docstring); None when nothing fits."""
    if plan.recommendation == "does-not-fit":
        return None
    placement = plan.colocated if plan.recommendation == "colocated" else plan.separate
    roles = {r.role: r for r in placement.roles}
    gpu = int(plan.inputs.gpu_memory_gib * 2**30)
    trainer, generator, scorer = roles["trainer"], roles["generator"], roles["scorer"]
    ranks = trainer.gpus
    has_scorer = bool(scorer.gpus)
    if plan.recommendation == "colocated":
        producers, producer_gpus = plan.inputs.gpus, _span(0, plan.inputs.gpus)
        scorer_gpus = "0" if has_scorer else ""
    else:
        first = ranks + int(has_scorer)
        producers = max(1, plan.inputs.gpus - first)
        producer_gpus = _span(first, producers)
        scorer_gpus = str(ranks) if has_scorer else ""
    return {
        "run": {"producers": producers, "trainer_ranks": ranks, "scorers": 1,
                "gpus": {"count": plan.inputs.gpus, "producers": producer_gpus, "trainer": _span(0, ranks),
                         "scorers": scorer_gpus, "trainer_memory": share(trainer.total, gpu),
                         "scorer_memory": share(scorer.total, gpu), "headroom": plan.inputs.headroom}},
        "producer": {"engine": "vllm", "vllm": {"tensor_parallel_size": 1,
                                                "gpu_memory_utilization": share(generator.total, gpu)}},
    }


def layout_toml(layout: dict) -> list[str]:
    """The layout as TOML tables: ``[run]``, ``[run.gpus]``, ``[producer]``, ``[producer.vllm]``."""
    def value(v) -> str:
        return f'"{v}"' if isinstance(v, str) else f"{v:g}" if isinstance(v, float) else str(v)

    lines: list[str] = []
    for table, path in (("run", ("run",)), ("run.gpus", ("run", "gpus")), ("producer", ("producer",)),
                        ("producer.vllm", ("producer", "vllm"))):
        node = layout
        for key in path:
            node = node[key]
        lines.append(f"[{table}]")
        lines += [f"{k} = {value(v)}" for k, v in node.items() if not isinstance(v, dict)]
    return lines
