"""CLI command ``stream-rl gc`` (registered in :mod:`stream_rl.cli.main`).

Consumes: the resolved config (where the run's checkpoints, weights store, logs, spans and telemetry files are:
``--run-dir``, else ``--run``'s or the newest run's directory, :mod:`stream_rl.cli.runs`) and the policy flags;
the defaults are the trainer's own ``trainer.keep_checkpoints`` and ``weights.keep_last``.
Produces: one line per removed (or, with ``--dry-run``, removable) item and a total on stdout; exit 2 on an invalid
config or policy or an unknown run (stderr names the run when it was picked as the newest).
Guarantees: ``--dry-run`` removes nothing; the rules are those of :mod:`stream_rl.operator_tools.gc` (the newest checkpoints
and weight versions are always kept). Unlike other commands, ``--dry-run`` here prints the plan, not the config
(``stream-rl config`` prints the config).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from stream_rl.cli.common import ConfigOpt, RunOpt, SetOpt, fail, resolve
from stream_rl.cli.runs import select_run


def gc(config: ConfigOpt = None, set_: SetOpt = None,
       run_dir: Annotated[Path | None, typer.Option(help="the run directory (run_dir; default: the newest run's, "
                                                    "or --run's)")] = None,
       run: RunOpt = None,
       dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would be removed; remove nothing")]
       = False,
       keep_checkpoints: Annotated[int | None, typer.Option(
           help="complete checkpoints to keep (default: trainer.keep_checkpoints)")] = None,
       keep_weights: Annotated[int | None, typer.Option(
           help="weight versions to keep in the store (default: weights.keep_last)")] = None,
       older_than: Annotated[float | None, typer.Option(
           help="also require this age in days before removing a checkpoint or weights file; run files (logs, "
                "spans, telemetry) are removed only when this is given")] = None) -> None:
    """Prune old checkpoints, weight versions and run files by policy (never the newest ones)."""
    from stream_rl.operator_tools.gc import DAY_S, GcPolicy, apply_gc, format_actions, paths_from_config, plan_gc

    cfg = resolve(config, set_, {"run_dir": str(run_dir) if run_dir is not None else None, "topics.run": run})
    select_run(cfg, "dir")
    try:
        policy = GcPolicy(
            keep_checkpoints=cfg.trainer.keep_checkpoints if keep_checkpoints is None else keep_checkpoints,
            keep_weights=cfg.weights.keep_last if keep_weights is None else keep_weights,
            older_than_s=None if older_than is None else older_than * DAY_S)
    except ValueError as exc:
        fail(f"invalid gc policy: {exc}", 2)
    actions = plan_gc(paths_from_config(cfg, cfg.trainer.checkpoint_dir), policy, time.time())
    if not dry_run:
        actions = apply_gc(actions)
    typer.echo(format_actions(actions, dry_run), nl=False)
