"""CLI commands ``stream-rl doctor`` and ``stream-rl report`` (registered in :mod:`stream_rl.cli.main`).

Consumes: the resolved config (doctor: the configured run, since it checks before a launch) or a run directory
(report: ``RUN_DIR``, else ``--run``'s or the newest run's, :mod:`stream_rl.cli.runs`).
Produces: the doctor's table (rich) or JSON on stdout, exit code 1 when a check fails; the report's files and its
summary on stdout, exit code 2 when the run has no metrics or is unknown; with ``--dry-run`` either prints the
resolved config (the chosen run in it) and exits 0.
Guarantees: heavy imports (torch, transformers, matplotlib) happen inside the commands, after parsing. The doctor
looks at the model settings as ``stream-rl run`` uses them (the demo's directories fill the settings left at their
defaults while ``run.demo_dir`` is set); ``--set run.demo_dir=null`` checks the settings as given.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from stream_rl.cli.common import BootstrapOpt, ConfigOpt, DryRunOpt, RunOpt, SetOpt, fail, resolve
from stream_rl.cli.runs import select_run
from stream_rl.operator_tools.report import Thresholds  # light: the defaults of the report's warning thresholds


def doctor(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
           model_dir: Annotated[list[Path] | None, typer.Option(
               "--model-dir", help="also check this model directory (repeatable)")] = None,
           min_free_gib: Annotated[float, typer.Option(help="warn when a filesystem has less free space")] = 10.0,
           as_json: Annotated[bool, typer.Option("--json", help="print the checks as JSON")] = False,
           dry_run: DryRunOpt = False) -> None:
    """Check the environment before a launch: PASS/WARN/FAIL with remedies; exit 1 when any check fails."""
    from stream_rl.cli.run_cmd import apply_demo
    from stream_rl.operator_tools.doctor import exit_code, run_checks

    cfg = resolve(config, set_, {"kafka.bootstrap_servers": bootstrap, "topics.run": run}, dry_run)
    if cfg.run.demo_dir is not None:
        apply_demo(cfg, Path(cfg.run.demo_dir))
    from stream_rl.cli.server_checks import server_checks

    checks = run_checks(cfg, role_facts(cfg), model_dir or [], min_free_gib) + server_checks(cfg)
    if as_json:
        typer.echo(json.dumps({"ok": exit_code(checks) == 0, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        _render(checks)
    raise typer.Exit(exit_code(checks))


def role_facts(cfg):
    """What the doctor checks of the roles' sections (:class:`stream_rl.operator_tools.doctor.RoleFacts`), read
    from the root config here, the one layer that holds every section."""
    from stream_rl.operator_tools.doctor import MODEL_SETTINGS, RoleFacts

    return RoleFacts(
        producer_engine=cfg.producer.engine, trainer_engine=cfg.trainer.engine, start_broker=cfg.run.start_broker,
        demo_dir=cfg.run.demo_dir, checkpoint_dir=cfg.trainer.checkpoint_dir,
        keep_checkpoints=cfg.trainer.keep_checkpoints,
        model_dirs=tuple((name, getattr(getattr(cfg, name.split(".")[0]), name.split(".")[1]))
                         for name in MODEL_SETTINGS))


def _render(checks) -> None:
    """The table (check, status, detail, remedy), then one line of counts."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    style = {"pass": "green", "warn": "yellow", "fail": "bold red"}
    table = Table(title="stream-rl doctor")
    for column in ("check", "status", "detail", "remedy"):
        table.add_column(column, overflow="fold")
    for c in checks:  # Text(...): details quote tensor shapes like [64, 16], which are not markup
        table.add_row(Text(c.name), Text(c.status.upper(), style=style[c.status]), Text(c.detail), Text(c.remedy))
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    counts = {s: sum(c.status == s for c in checks) for s in style}
    console.print(f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed")


def report(run_dir: Annotated[Path | None, typer.Argument(help="the run directory (holds metrics.jsonl; default: "
                                                            "the newest run's, or --run's)")] = None,
           out: Annotated[Path | None, typer.Option(help="output directory (default: RUN_DIR/report)")] = None,
           kl_max: Annotated[float, typer.Option(help="warn when kl/ref_mean exceeds this")] = Thresholds.kl_max,
           reward_drop: Annotated[float, typer.Option(
               help="warn when the last 10% mean reward is this much below the first 10%")] = Thresholds.reward_drop,
           mismatch_max: Annotated[float, typer.Option(
               help="warn when the mean mismatch/logp_abs_diff exceeds this")] = Thresholds.mismatch_max,
           config: ConfigOpt = None, set_: SetOpt = None, run: RunOpt = None, dry_run: DryRunOpt = False) -> None:
    """Plot a run's metrics (PNGs and one self-contained HTML page) and print a summary of its health."""
    from stream_rl.operator_tools.report import ReportError, build_report

    flags = {"topics.run": run, "run_dir": None if run_dir is None else str(run_dir)}
    run_dir = Path(select_run(resolve(config, set_, flags), "dir", dry_run).run_dir)
    try:
        text, where = build_report(run_dir, out, Thresholds(kl_max=kl_max, reward_drop=reward_drop,
                                                            mismatch_max=mismatch_max))
    except ReportError as exc:
        fail(str(exc), 2)
    typer.echo(text, nl=False)
    typer.echo(f"report: {where / 'report.html'} (plots and summary.txt in {where})")
