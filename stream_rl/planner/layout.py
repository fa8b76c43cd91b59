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
  each GPU left (``run.producers`` = their count);
- **servers** (``--servers N``, separate only): as separate, with N inference servers (``[run.servers]``) on the
  GPUs after the scorer's, each with its GPU's all but the headroom, ``floor(100 / (1 + headroom)) / 100``, as
  ``--gpu-memory-utilization`` (a server alone on its GPU turns the rest into KV cache), one producer per
  server (``producer.engine = "server"``; producers see no GPU). Servers on other machines are not started by
  ``stream-rl run``: list their URLs in ``producer.server.urls`` instead (docs/operations.md).
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
    gpus = {"count": plan.inputs.gpus, "producers": producer_gpus, "trainer": _span(0, ranks),
            "scorers": scorer_gpus, "trainer_memory": share(trainer.total, gpu),
            "scorer_memory": share(scorer.total, gpu), "headroom": plan.inputs.headroom}
    memory = share(generator.total, gpu)
    if plan.inputs.servers:  # a server on each GPU after the trainer's and the scorer's; producers see no GPU
        first, n = ranks + int(has_scorer), plan.inputs.servers
        alone = math.floor(100 / (1 + plan.inputs.headroom) + 1e-9) / 100  # all but the headroom: KV cache
        servers = {"count": n, "gpus": [str(first + i) for i in range(n)],
                   "extra_args": ["--gpu-memory-utilization", f"{max(memory, alone):g}"]}
        return {"run": {"producers": n, "trainer_ranks": ranks, "scorers": 1, "gpus": {**gpus, "producers": ""},
                        "servers": servers},
                "producer": {"engine": "server"}}
    return {
        "run": {"producers": producers, "trainer_ranks": ranks, "scorers": 1, "gpus": gpus},
        "producer": {"engine": "vllm", "vllm": {"tensor_parallel_size": 1, "gpu_memory_utilization": memory}},
    }


def layout_toml(layout: dict) -> list[str]:
    """The layout as TOML tables: ``[run]``, ``[run.gpus]``, ``[run.servers]``, ``[producer]``,
    ``[producer.vllm]`` (those it has)."""
    def value(v) -> str:
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return f'"{v}"' if isinstance(v, str) else f"{v:g}" if isinstance(v, float) else str(v)

    lines: list[str] = []
    for table in ("run", "run.gpus", "run.servers", "producer", "producer.vllm"):
        node = layout
        for key in table.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue
        lines.append(f"[{table}]")
        lines += [f"{k} = {value(v)}" for k, v in node.items() if not isinstance(v, dict)]
    return lines
