"""Where `stream-rl run` puts its roles on the machine it runs on: cores, compute threads and partition counts.

Consumes: the cores this process may run on (``os.sched_getaffinity``), the run's role counts (``run.producers``,
``run.scorers``, ``run.trainer_ranks``) and whether the user set ``topics.partitions``.
Produces: a :class:`Placement` (cores and torch threads per role, one line saying what was chosen) and, with
:func:`sized_partitions`, the partition counts of the run's data topics; :func:`pin_tree` applies a core set to
every thread of a running process and of the processes below it.
Guarantees: pure apart from :func:`pin`, :func:`pin_tree`, :func:`descendants` and :func:`usable_cores`; a role is
never left without a core; with fewer cores than trainer ranks + 1 nothing is pinned (the kernel places everything,
as before placement existed).

Why (measured on 2 cores with the demo, README "make run"; docs/benchmarks.md "Against TRL"): the trainer's update
is the one stage that is busy all the time, and three roles plus the broker that the kernel moves freely take its
core from it at every step. So each trainer rank gets a core of its own (and the torch threads of the cores it
holds) and the producers the rest, one compute thread each: a role that starts one thread per core on a shared
core stalls in OpenMP barriers (measured: 3-4x slower steps). Scorers and the local broker are left to the kernel,
which runs them wherever a core is idle; pinned beside the producer they made it the bottleneck (80 s for the
demo's 180 steps, 61 s unpinned). Partitions: each data topic of a run gets as many partitions as it has consumers
in it (prompts: producers; rollouts: scorers; scored: 1, since the trainer's rank 0 reads every partition). On the
durable local broker every partition of a produce or commit is its own object write: the demo's broker work fell
from 41 to 24 CPU-seconds over 180 steps with 1 partition instead of 4.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DATA_TOPICS = ("prompts", "rollouts", "scored")


@dataclass(frozen=True)
class Placement:
    """Cores and torch threads of each role (``train``, ``produce``, ``score``); an empty core set: unpinned."""

    cores: dict[str, frozenset[int]]  # role -> cores it may run on (empty: wherever the kernel puts it)
    threads: dict[str, int]  # role -> torch/OpenMP threads per process (per rank for train)

    def describe(self) -> str:
        """One line: what was chosen, for the run's output."""
        if not self.cores["train"]:
            return (f"placement: not pinned; threads per process: train {self.threads['train']}, "
                    f"produce {self.threads['produce']}, score {self.threads['score']}")

        def cores(c: frozenset[int]) -> str:
            return ",".join(str(x) for x in sorted(c))

        return (f"placement (from the first step): train on core(s) {cores(self.cores['train'])} "
                f"({self.threads['train']} thread(s) per rank), produce on core(s) {cores(self.cores['produce'])} (1 thread each); score and the broker "
                f"where the kernel finds room (1 thread each)")


def plan(cores: list[int], trainer_ranks: int, mode: str = "auto") -> Placement:
    """The placement for ``cores`` (sorted ids) and ``trainer_ranks``.

    ``auto`` with at least ``trainer_ranks + 1`` cores: the trainer ranks take the first cores (half of them when
    there are more than twice as many cores as ranks, else all but one), the producers the others, scorers float.
    Otherwise (``none``, or too few cores) nothing is pinned and every process gets one thread."""
    ones = {"train": 1, "produce": 1, "score": 1}
    if mode == "none" or len(cores) < trainer_ranks + 1:
        return Placement({"train": frozenset(), "produce": frozenset(), "score": frozenset()}, ones)
    shared = max(1, len(cores) // 2) if len(cores) > 2 * trainer_ranks else len(cores) - trainer_ranks
    trainer_cores = cores[:len(cores) - shared]
    per_rank = max(1, len(trainer_cores) // trainer_ranks)
    return Placement({"train": frozenset(trainer_cores), "produce": frozenset(cores[len(cores) - shared:]),
                      "score": frozenset()}, {**ones, "train": per_rank})


def sized_partitions(partitions: dict[str, int], producers: int, scorers: int) -> dict[str, int]:
    """``partitions`` with the data topics sized to their consumers: prompts = producers, rollouts = scorers,
    scored = 1 (the trainer's rank 0 consumes every partition). Other topics keep their counts."""
    return {**partitions, "prompts": producers, "rollouts": scorers, "scored": 1}


def usable_cores() -> list[int]:
    """The cores this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (a trainer's ranks under its launcher), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat[stat.rfind(")") + 2:].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def pin_tree(pid: int, cores: frozenset[int]) -> None:
    """:func:`pin` ``pid`` and every process below it."""
    if cores:
        for member in descendants(pid):
            pin(member, cores)


def pin(pid: int, cores: frozenset[int]) -> None:
    """Restrict every thread of process ``pid`` to ``cores`` (threads started later inherit the main thread's
    set). A process or thread that has just ended is skipped; an empty set does nothing."""
    if not cores:
        return
    tasks = Path(f"/proc/{pid}/task")
    try:
        tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [pid]
    except OSError:
        return  # the process ended
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):
            pass
