"""CLI command ``stream-rl evaluate`` (registered in :mod:`stream_rl.cli.main`).

Consumes: the resolved config (``[eval]`` required; the policy engine from ``producer``, its model taken from the
built demo when left at its default), and either nothing (follow the run), ``--model DIR`` (a save_pretrained
directory) or ``--checkpoint DIR`` (a trainer checkpoint, merged onto ``trainer.model_dir`` as ``stream-rl export``
does).
Produces: following the run: the evaluator role (:func:`evaluator.role.run_evaluator`: Evaluation
records on the evals topic, rows in ``RUN_DIR/evals.jsonl``); once: one JSON line on stdout,
``{"model": DIR, "version": 0, "metrics": {...}}``, and no broker is needed.
Guarantees: a missing ``[eval]`` section, ``--model`` with ``--checkpoint``, or a checkpoint that cannot be
exported exits 2 with one line naming it; a set that fails validation names its file and line (the prompt
loader's error, exit 2); exit codes of the role as for the other roles (:mod:`stream_rl.cli.roles_cmd`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from stream_rl.cli.common import BootstrapOpt, ConfigOpt, DryRunOpt, RunOpt, SetOpt, fail, require_broker, resolve
from stream_rl.cli.roles_cmd import InstanceOpt


def evaluate(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
             instance: InstanceOpt = None,
             model: Annotated[Path | None, typer.Option(
                 "--model", help="evaluate this save_pretrained directory once and exit (no broker)")] = None,
             checkpoint: Annotated[Path | None, typer.Option(
                 "--checkpoint", help="evaluate this trainer checkpoint (step-*) once and exit (no broker)")] = None,
             max_evaluations: Annotated[int | None, typer.Option(
                 help="following the run: stop after this many evaluations")] = None,
             dry_run: DryRunOpt = False) -> None:
    """Evaluate policy versions on the held-out sets of [eval]: follow the run, or one --model/--checkpoint once."""
    from stream_rl.cli.run_cmd import apply_demo
    from stream_rl.config.loading import dump_config

    if model is not None and checkpoint is not None:
        fail("--model and --checkpoint exclude each other: pass one", 2)
    flags = {"kafka.bootstrap_servers": bootstrap, "topics.run": run}
    cfg = resolve(config, set_, flags)
    if instance is not None and cfg.eval is not None:
        cfg.eval.evaluator_id = f"evaluator-{instance}"
    demo = cfg.run.demo_dir
    if demo is not None and (demo / "policy").is_dir():
        apply_demo(cfg, demo)
    if cfg.eval is None:
        fail("stream-rl evaluate needs an [eval] section: set eval.sets (name = \"prompts.jsonl\")", 2)
    if dry_run:
        typer.echo(dump_config(cfg))
        raise typer.Exit(0)
    if model is not None or checkpoint is not None:
        _once(cfg, model, checkpoint)
        return
    require_broker(cfg)
    _follow(cfg, max_evaluations)


def _follow(cfg, max_evaluations: int | None) -> None:
    from evaluator.role import run_evaluator
    from stream_rl.cli.roles_cmd import run_role, setup_logging, stop_on_signals
    from stream_rl.prompts import PromptFileError

    setup_logging()
    try:
        run_role(run_evaluator, cfg, cfg.eval, cfg.producer, stop_event=stop_on_signals(),
                 max_evaluations=max_evaluations)
    except (PromptFileError, ValueError) as exc:
        fail(f"evaluate: {exc}", 2)


def _once(cfg, model: Path | None, checkpoint: Path | None) -> None:
    from evaluator.role import evaluate_once
    from stream_rl.prompts import PromptFileError

    with tempfile.TemporaryDirectory(prefix="stream-rl-eval-") as tmp:
        cfg.producer.model_dir = model if model is not None else _exported(cfg, checkpoint, Path(tmp) / "policy")
        try:
            msg = evaluate_once(cfg, cfg.eval, cfg.producer)
        except (PromptFileError, ValueError) as exc:
            fail(f"evaluate: {exc}", 2)
    source = str(model if model is not None else checkpoint)
    typer.echo(json.dumps({"model": source, "version": msg.version, "metrics": msg.metrics}, sort_keys=True))


def _exported(cfg, checkpoint: Path, out: Path) -> Path:
    from consumers.trainer.export import export_checkpoint
    from stream_rl.storage.checkpoint import CheckpointError

    if cfg.trainer.model_dir is None:
        fail("--checkpoint needs the base model it was trained from: set trainer.model_dir", 2)
    try:
        return export_checkpoint(checkpoint, cfg.trainer.model_dir, out)
    except (FileExistsError, CheckpointError, ValueError, OSError) as exc:
        fail(f"--checkpoint {checkpoint}: cannot read it: {exc}", 2)
