"""Elastic cores (``run.placement = "elastic"``): roles that have nothing to do lend their cores to the trainer.

Consumes: the environment ``stream-rl run`` gives each role it starts with the elastic placement
(:func:`lease_env`): the lease directory, this process's name, and for the trainer the number of lenders and the
run's cores. Without it every object here does nothing, so a role started by hand behaves as before.
Produces: :class:`Lender` (a producer blocked by backpressure, a scorer or evaluator with nothing to do) and
:class:`Borrower` (the trainer, around its update): while every lender has lent, the trainer's update runs on all
the run's cores with one torch thread per core; otherwise on its own cores with its own threads.
Guarantees (the protocol, files in one directory, tested in tests/unit/test_lease.py):
- the borrower widens only while every lender's ``lent-<name>`` file exists, and announces it with ``borrowed``
  before it re-checks the lenders (a lender that reclaimed in between is seen, and the borrower narrows at once);
- a lender reclaims by removing its file and then waits for ``borrowed`` to go: it never computes while the trainer
  holds its core, unless the trainer fails to narrow within ``reclaim_timeout_s`` (then it goes on: a stalled or
  dead trainer never stalls the rest of the run);
- nothing about data, offsets or versions depends on it: only where and on how many threads compute runs.

Why files (measured alternatives in docs/benchmarks.md, "Elastic cores"): the roles are separate processes that
must be killable with -9 at any moment; an ``os.path.exists`` costs microseconds, which is nothing beside a
training step, and a lender dead while lent leaves at most a core the trainer keeps using (nothing computes there).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

ENV_DIR = "SRL_LEASE_DIR"
ENV_NAME = "SRL_LEASE_NAME"
ENV_LENDERS = "SRL_LEASE_LENDERS"
ENV_CORES = "SRL_LEASE_CORES"
BORROWED = "borrowed"


def lease_env(directory: Path, name: str, lenders: int, cores: frozenset[int]) -> dict[str, str]:
    """The environment of one process of an elastic run: ``name`` is ``<role>-<index>``; the trainer (``train-0``)
    also learns how many lenders there are and every core of the run."""
    env = {ENV_DIR: str(directory), ENV_NAME: name}
    if name.startswith("train"):
        env.update({ENV_LENDERS: str(lenders), ENV_CORES: ",".join(str(c) for c in sorted(cores))})
    return env


class Lender:
    """A role that lends its core while idle: :meth:`lend` before waiting, :meth:`reclaim` before computing."""

    def __init__(self, directory: Path | None, name: str = "", reclaim_timeout_s: float = 5.0, poll_s: float = 0.002):
        self.dir, self.name = directory, name
        self.timeout_s, self.poll_s = reclaim_timeout_s, poll_s
        self.lent = False
        self.late_reclaims = 0  # reclaims that gave up waiting for the trainer to narrow

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Lender:
        env = os.environ if env is None else env
        directory = env.get(ENV_DIR)
        return cls(Path(directory) if directory else None, env.get(ENV_NAME, "role"))

    @property
    def active(self) -> bool:
        return self.dir is not None

    def lend(self) -> None:
        """Announce that this process will not compute until :meth:`reclaim`. Idempotent."""
        if self.dir is None or self.lent:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"lent-{self.name}").write_bytes(b"")
        self.lent = True

    def reclaim(self) -> float:
        """Take the core back: withdraw the loan, then wait until the trainer no longer borrows (bounded).
        Returns the seconds waited (0 when nothing was lent)."""
        if self.dir is None or not self.lent:
            return 0.0
        (self.dir / f"lent-{self.name}").unlink(missing_ok=True)
        self.lent = False
        start = time.monotonic()
        while (self.dir / BORROWED).exists():
            if time.monotonic() - start > self.timeout_s:
                self.late_reclaims += 1
                break
            time.sleep(self.poll_s)
        return time.monotonic() - start

    def close(self) -> None:
        """A role that ends withdraws its loan without waiting (a process that is gone computes nothing)."""
        if self.dir is not None:
            (self.dir / f"lent-{self.name}").unlink(missing_ok=True)
        self.lent = False


class Borrower:
    """The trainer's side: :meth:`widen` before (and between parts of) its update, :meth:`narrow` after it."""

    def __init__(self, directory: Path | None, lenders: int = 0, cores: frozenset[int] = frozenset(),
                 set_threads=None):
        self.dir, self.lenders, self.cores = directory, lenders, frozenset(cores)
        self._set_threads = set_threads  # torch.set_num_threads (injected: this module imports no torch)
        self.narrow_state: tuple[frozenset[int], int] | None = None  # (affinity, threads) while wide
        self._wide_set: frozenset[int] = frozenset()
        self.wide_updates = 0

    @classmethod
    def from_env(cls, set_threads, env: Mapping[str, str] | None = None) -> Borrower:
        env = os.environ if env is None else env
        directory, cores = env.get(ENV_DIR), env.get(ENV_CORES, "")
        if not directory or not cores:
            return cls(None)
        return cls(Path(directory), int(env.get(ENV_LENDERS, "0")),
                   frozenset(int(c) for c in cores.split(",")), set_threads)

    @property
    def active(self) -> bool:
        return self.dir is not None and bool(self.cores)

    @property
    def wide(self) -> bool:
        return self.narrow_state is not None

    def all_lent(self) -> bool:
        return self.dir is not None and sum(1 for _ in self.dir.glob("lent-*")) >= self.lenders

    def widen(self, threads_now: int) -> bool:
        """Run on every core of the run (one thread per core) if every lender has lent; narrow back at once if one
        has reclaimed meanwhile. Returns whether the process is wide now."""
        if not self.active:
            return False
        if self.wide:
            if not self.all_lent():
                self.narrow()
            return self.wide
        if not self.all_lent():
            return False
        (self.dir / BORROWED).write_bytes(b"")
        if not self.all_lent():  # a lender reclaimed between the two looks: it is waiting for BORROWED to go
            (self.dir / BORROWED).unlink(missing_ok=True)
            return False
        self.narrow_state = (frozenset(os.sched_getaffinity(0)), threads_now)
        self._wide_set = self.cores | self.narrow_state[0]
        _set_affinity(self._wide_set)
        self._set_threads(len(self._wide_set))
        self.wide_updates += 1
        return True

    def narrow(self) -> None:
        """Back to the trainer's own cores and threads, then release the lenders. Idempotent. Pinned by someone
        else while wide (``stream-rl run`` pins its roles once training starts), it keeps that pinning."""
        if self.narrow_state is None:
            return
        cores, threads = self.narrow_state
        self._set_threads(threads)
        if frozenset(os.sched_getaffinity(0)) == self._wide_set:
            _set_affinity(cores)
        self.narrow_state = None
        (self.dir / BORROWED).unlink(missing_ok=True)


def _set_affinity(cores: frozenset[int]) -> None:
    """Every thread of this process on ``cores`` (threads started later inherit the caller's set)."""
    from stream_rl.launch.placement import pin

    os.sched_setaffinity(0, cores)
    pin(os.getpid(), cores)
