"""Benchmark 14, elastic cores: `stream-rl run` on the demo with ``run.placement`` none, auto and elastic, and where
each CPU-second of a step goes.

Consumes: the demo (:func:`bench.demo_runs.demo_dir`) and ``configs/demo.toml`` (``make run``'s settings, its
evaluator included), run through the product's own command, each run with its own durable local broker (as
``make run``), the variants interleaved, at least 3 rounds in the full mode.
Produces, per variant: trainer steps/s from the end of step ``skip`` to the last step; the CPU-seconds per step of
each process group in that window (trainer, producer, scorer, evaluator, the broker, the supervisor), sampled from
``/proc/<pid>/stat`` every 0.25 s over the run's process tree; for ``elastic``, the share of steps whose update
ran on every core (the trainer's ``placement/wide_phases``). Figures: medians; ``elastic_over_auto``; the floor
``cpu_s_per_step / cores`` (no placement can beat it: every core busy all the time) and how close ``auto`` gets
to it (``auto_floor_ratio``: floor seconds per step / measured seconds per step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import demo_runs as dr
from bench.common import BenchContext, fmt, interleave, medians
from stream_rl.launch.placement import descendants

TITLE = "Elastic cores"
VARIANTS = ("none", "auto", "elastic")
GROUPS = ("train", "produce", "score", "evaluate", "broker", "supervisor")
TICK = os.sysconf("SC_CLK_TCK")


def sizes(ctx: BenchContext) -> dict[str, Any]:
    return ctx.pick(full={"skip": 5, "steps": 60, "deadline_s": 600},
                    quick={"skip": 2, "steps": 12, "deadline_s": 300},
                    tiny={"skip": 1, "steps": 3, "deadline_s": 240})


def group_of(cmdline: str) -> str:
    """The process group of a command line of the run's tree (the broker: tansu or its object store)."""
    if "stream_rl.cli.main" in cmdline:
        for role in ("train", "produce", "score", "evaluate"):
            if f" {role} " in f" {cmdline} ":
                return role
        return "supervisor"
    return "broker"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (its threads included); None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = fields[fields.rfind(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / TICK


class CpuSampler:
    """Samples the CPU seconds of every process under ``root`` until stopped: per group, at each tick (a process
    that ended keeps its last sample)."""

    def __init__(self, root: int, period_s: float = 0.25):
        self.root, self.period_s = root, period_s
        self.last: dict[int, tuple[str, float]] = {}
        self.series: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)

    def sample(self) -> None:
        for pid in descendants(self.root):  # the run's process tree, from /proc
            seconds = cpu_seconds(pid)
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if seconds is not None:
                self.last[pid] = (group_of(cmd), seconds)
        totals: dict[str, float] = {}
        for group, seconds in self.last.values():
            totals[group] = totals.get(group, 0.0) + seconds
        self.series.append((time.time(), totals))

    def between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds per group spent between wall times ``start`` and ``end`` (the nearest samples)."""
        def at(t: float) -> dict[str, float]:
            return min(self.series, key=lambda s: abs(s[0] - t))[1]

        a, b = at(start), at(end)
        return {g: b.get(g, 0.0) - a.get(g, 0.0) for g in set(a) | set(b)}


def command(demo: Path, variant: str, steps: int, run_dir: Path, deadline_s: float) -> list[str]:
    sets = {"broker.state_dir": run_dir / "broker", "topics.run": f"bench-elastic-{uuid.uuid4().hex[:8]}",
            "run_dir": run_dir, "run.demo_dir": demo, "trainer.max_steps": steps, "run.placement": variant,
            "run.max_wall_s": deadline_s}
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "run", "-c", str(dr.DEMO_TOML)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def one_run(ctx: BenchContext, demo: Path, variant: str, size: Mapping[str, Any]) -> dict[str, float]:
    """One `stream-rl run`; its figures (see the module docstring)."""
    from bench.trl_peer import _env

    total = size["skip"] + size["steps"]
    run_dir = ctx.workdir / f"elastic-{variant}-{uuid.uuid4().hex[:6]}"
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        proc = subprocess.Popen(command(demo, variant, total, run_dir, size["deadline_s"]), cwd=dr.ROOT,
                                env=_env(None), stdout=out, stderr=subprocess.STDOUT)
        with CpuSampler(proc.pid) as sampler:
            try:
                proc.wait(timeout=size["deadline_s"] + 120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    if proc.returncode != 0 or len(rows) != total:
        raise RuntimeError(f"{variant}: exit {proc.returncode}, {len(rows)} of {total} steps\n"
                           f"{log.read_text()[-3000:]}\n{dr.log_tails(run_dir)}")
    return figures_of(variant, rows, sampler, size["skip"], size["steps"])


def figures_of(variant: str, rows: Sequence[Mapping[str, Any]], sampler: CpuSampler, skip: int,
               steps: int) -> dict[str, float]:
    start, end = float(rows[skip - 1]["time"]), float(rows[-1]["time"])
    cpu = sampler.between(start, end)
    out = {f"{variant}.steps_per_s": steps / (end - start),
           f"{variant}.cpu_s_per_step": sum(cpu.values()) / steps}
    out.update({f"{variant}.cpu.{g}": cpu.get(g, 0.0) / steps for g in GROUPS})
    if variant == "elastic":
        timed = rows[skip:]
        out["elastic.wide_steps"] = sum(float(r["placement/wide_phases"]) > 0 for r in timed) / len(timed)
    return out


def run(ctx: BenchContext) -> dict[str, Any]:
    demo = dr.demo_dir(ctx)
    size = sizes(ctx)
    ctx.log(f"elastic: placement none / auto / elastic, {size['skip'] + size['steps']} steps each, "
            f"{size['steps']} timed, {ctx.rounds} rounds")
    samples = interleave([(v, lambda v=v: one_run(ctx, demo, v, size)) for v in VARIANTS], ctx.rounds, ctx.log,
                         ctx.min_rounds)
    figures = medians(samples)
    cores = len(dr.usable_cores())
    figures["elastic_over_auto"] = figures["elastic.steps_per_s"] / figures["auto.steps_per_s"]
    figures["auto.floor_s_per_step"] = figures["auto.cpu_s_per_step"] / cores
    figures["auto_floor_ratio"] = figures["auto.floor_s_per_step"] * figures["auto.steps_per_s"]
    figures = {k: v for k, v in figures.items() if v > 0 or not k.startswith(("none.cpu.", "auto.cpu.",
                                                                               "elastic.cpu."))}
    if figures.get("elastic.wide_steps", 0.0) <= 0:  # a share of 0 is a finding, not a broken figure
        figures.pop("elastic.wide_steps", None)
    wide = samples.get("elastic.wide_steps", [])
    notes = [f"`stream-rl run -c configs/demo.toml --set run.placement=VARIANT` ({size['skip'] + size['steps']} "
             f"steps; the window: end of step {size['skip']} to the last), medians of {ctx.rounds} interleaved "
             f"rounds on {cores} cores; CPU from /proc over the run's process tree.",
             f"elastic: share of timed steps whose update ran on every core, per run: "
             f"{', '.join(fmt(w) for w in wide) or '–'}."]
    return {"figures": figures, "samples": samples, "notes": notes,
            "params": {**size, "cores": cores, "repeats": ctx.rounds, "variants": list(VARIANTS)}}


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    f = result["figures"]
    rows = []
    for v in VARIANTS:
        ratio = f"{fmt(f[f'{v}.steps_per_s'] / f['auto.steps_per_s'])}×"
        rows.append([v, fmt(f[f"{v}.steps_per_s"]), ratio, fmt(f[f"{v}.cpu_s_per_step"])]
                    + [fmt(f.get(f"{v}.cpu.{g}", 0.0)) for g in GROUPS])
    return ["run.placement", "steps/s (median)", "vs auto", "CPU-s per step"] + [f"{g} CPU-s" for g in GROUPS], rows


def headline(result: Mapping[str, Any]) -> str:
    f = result["figures"]
    return (f"elastic {fmt(f['elastic_over_auto'])}x auto's steps/s; auto at {fmt(f['auto_floor_ratio'])} of the "
            f"floor ({fmt(f['auto.cpu_s_per_step'])} CPU-s per step on {result['params']['cores']} cores)")
