"""The plan as text: per-GPU memory per role and component, colocated against separate, each placement's verdict
with its reason, the recommendation and the trainer's launch line (what ``stream-rl plan`` prints without
``--json``).

Consumes: a :class:`~stream_rl.planner.plan.Plan`. Produces: a string. Guarantees: pure formatting, every number
comes from the plan (no estimate is made here) and carries its unit at a readable scale (``592 K parameters``,
``1.5 MiB``, ``12.3 GiB``; :mod:`~stream_rl.planner.units`).
"""

from __future__ import annotations

from stream_rl.planner.layout import layout_toml, propose_layout
from stream_rl.planner.plan import Plan, RoleMemory, verdict
from stream_rl.planner.units import human_bytes, human_count, human_gib


def _role_rows(colocated: RoleMemory | None, separate: RoleMemory) -> list[tuple[str, str, str, str]]:
    def gpus(r: RoleMemory | None) -> str:
        return "n/a" if r is None else "-" if r.gpus is None else str(r.gpus)

    def gib(r: RoleMemory | None, name: str | None = None) -> str:
        if r is None:
            return "n/a"
        return human_bytes(dict(r.components)[name] if name else r.total)

    label = "ranks (GPUs)" if separate.role == "trainer" else "GPUs"
    rows = [(separate.role, label, gpus(colocated), gpus(separate))]
    rows += [("", name, gib(colocated, name), gib(separate, name)) for name, _ in separate.components]
    rows.append(("", "total", gib(colocated), gib(separate)))
    return rows


def _head(plan: Plan) -> str:
    i = plan.inputs
    if i.dtype == "fp32":
        precision = f"fp32, {i.optimizer}"
    elif i.use_master_weights:
        precision = f"{i.dtype} compute, fp32 weights/gradients/{i.optimizer}"
    else:
        precision = f"{i.dtype} weights/gradients, fp32 {i.optimizer}"
    ranks = i.trainer_ranks if i.trainer_ranks is not None else "fewest that fit"
    return (f"{human_count(plan.params)} parameters ({plan.params:,}), {precision}, ZeRO {i.zero_stage}, "
            f"trainer ranks {ranks}, {i.gpus} x {human_gib(i.gpu_memory_gib)} GPUs, headroom {i.headroom:.0%}")


def _launch_lines(plan: Plan) -> list[str]:
    launch = plan.trainer_launch
    if launch is None:
        return []
    sharded = {0: "nothing sharded (plain DDP)", 1: "optimizer states sharded", 2: "optimizer states and gradients "
               "sharded", 3: "optimizer states, gradients and weights sharded"}[launch.zero_stage]
    where = (f"on each of {launch.nnodes} machines, {launch.nproc_per_node} ranks each "
             f"(--gpus-per-node {plan.inputs.gpus_per_node})" if launch.nnodes > 1 else "on one machine")
    return [f"trainer: {launch.ranks} data-parallel rank(s), ZeRO {launch.zero_stage}: {sharded} over "
            f"{launch.ranks}", f"launch, {where}: {launch.command}"]


def render_table(plan: Plan) -> str:
    """A plain-text table of per-GPU memory per role and component, colocated vs separate, each placement's
    verdict, the recommendation and the trainer's launch line."""
    co, se = plan.colocated, plan.separate
    rows = [("role", "component", "colocated, per GPU", "separate, per GPU")]
    colocated_roles = co.roles or (None,) * len(se.roles)
    for c, s in zip(colocated_roles, se.roles):
        rows += _role_rows(c, s)
    na = co.reason is not None
    rows.append(("all", "per GPU + headroom", "n/a" if na else human_bytes(co.needed_per_gpu),
                 human_bytes(se.needed_per_gpu)))
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    lines = [_head(plan), ""] + ["  ".join(r[k].ljust(widths[k]) if k < 2 else r[k].rjust(widths[k])
                                           for k in range(4)) for r in rows]
    lines += ["", f"colocated: {verdict(plan.inputs, co)}", f"separate: {verdict(plan.inputs, se)}"]
    lines += [f"recommendation: {plan.message}"] + _launch_lines(plan) + [f"note: {n}" for n in plan.notes]
    layout = propose_layout(plan)
    if layout is not None:
        lines += ["", "stream-rl run layout (paste into the config; checked by `stream-rl run --dry-run`):"]
        lines += ["  " + line for line in layout_toml(layout)]
    return "\n".join(lines)
