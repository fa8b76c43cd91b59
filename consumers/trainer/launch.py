"""``stream-rl train --nproc N [--nnodes M --rdzv-endpoint HOST:PORT]``: the trainer's ranks through torch's own
elastic launcher (what ``torchrun`` runs), not a home-made one.

Consumes: the number of ranks per machine and machines, the rendezvous endpoint, and the role's command line for
one rank (``python -m stream_rl.cli.main train --config FILE ...``: a resolved config file, so every rank on every
machine trains under the same settings).
Produces: N local rank processes with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
set (global rank 0 is the leader that owns Kafka; see :mod:`consumers.trainer.ranks`); on failure a
:class:`RankDied` naming the rank that failed first on its own (not one that only lost its peer).
Guarantees:
- One failure stops the group: when a rank exits with an error or is killed, the launcher stops every other local
  rank (SIGTERM, then SIGKILL after ``SHUTDOWN_S``) and does not restart them (``max_restarts=0``): the restart is
  ``stream-rl train --resume``, which continues from the newest checkpoint with nothing lost or trained twice.
  Ranks on other machines lose their peer in the next collective and stop within ``trainer.collective_timeout_s``.
- SIGTERM/SIGINT to the launcher reach every rank; the leader finishes its step and checkpoints, the followers
  take part in that checkpoint and stop when it says so.
- A rank that finished its work leaves through :func:`exit_rank_cleanly` (exit handlers run, then ``os._exit(0)``),
  so a C++ teardown abort cannot turn a finished run into a failed rank.
- ``--nnodes 1`` uses a private rendezvous on a free local port (torchrun's ``--standalone``); with more machines
  each one runs the same command with the same ``--rdzv-endpoint`` (torchrun's c10d rendezvous).
"""

from __future__ import annotations

import signal
import sys
import uuid
from collections.abc import Sequence
from typing import Any

SHUTDOWN_S = 120  # after a SIGTERM to the group, how long ranks may take to finish (the leader checkpoints)


class RankDied(RuntimeError):
    """A trainer rank failed; the message names it and says how to continue."""

    def __init__(self, rank: int, exitcode: int, detail: str):
        super().__init__(f"trainer rank {rank} failed ({detail}); every rank was stopped")
        self.rank, self.exitcode = rank, exitcode


def _detail(failure) -> str:
    if failure.exitcode < 0:
        try:
            name = signal.Signals(-failure.exitcode).name
        except ValueError:
            name = f"signal {-failure.exitcode}"
        return f"killed by {name}"
    lines = str(failure.message or "").strip().splitlines()  # the rank's exception, recorded by record_errors
    first = lines[0] if lines and "To enable traceback" not in lines[0] else ""
    return f"exit code {failure.exitcode}" + (f": {first}" if first else "")


def record_errors(fn):
    """``fn`` writing its exception to the launcher's error file when it runs as a rank (torch's ``record``), so
    :class:`RankDied` can name the error; ``fn`` itself otherwise."""
    import os

    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return fn
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


def running_as_rank() -> bool:
    """Whether this process is a rank started by torch's elastic launcher (``stream-rl train --nproc N``)."""
    import os

    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_ERROR_FILE" in os.environ


def exit_rank_cleanly() -> None:
    """End a rank that finished its work: Python's exit handlers, flushed streams, then ``os._exit(0)``.

    A rank's process group leaves C++ threads (gloo, the c10d store) behind; at interpreter teardown their
    destructors sometimes abort with "terminate called without an active exception" (SIGABRT, measured on 1 of 4
    fresh-clone test runs, after the rank had trained, checkpointed and logged "stop"), which the launcher reports
    as a failed rank. Everything a rank owns is already closed when its loop returns, so the process leaves without
    running C++ static destructors."""
    import atexit
    import logging
    import os

    atexit._run_exitfuncs()  # telemetry exporters and the like flush here, as at a normal exit
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def launch_ranks(rank_args: Sequence[str], *, nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None,
                 run_id: str | None = None) -> None:
    """Run ``python -m stream_rl.cli.main *rank_args`` as ``nproc`` ranks here (of ``nproc * nnodes``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every machine)")
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=run_id or uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint=rdzv_endpoint or "localhost:0", max_restarts=0, monitor_interval=0.5,
        start_method="spawn", shutdown_timeout=SHUTDOWN_S)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "stream_rl.cli.main", *rank_args)
    except ChildFailedError as exc:
        rank, failure = root_cause(exc.failures)
        raise RankDied(rank, failure.exitcode, _detail(failure)) from None


def root_cause(failures: dict) -> tuple[int, Any]:
    """The failed rank to name: the earliest that did not fail only because a peer was lost (a ``RankFailure``,
    which every surviving rank raises after the real failure); the earliest of all if each one did."""
    ranked = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    own = [item for item in ranked if "RankFailure" not in str(item[1].message or "")]
    return (own or ranked)[0]
