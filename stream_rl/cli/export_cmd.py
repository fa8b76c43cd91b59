"""CLI command ``stream-rl export`` (registered in :mod:`stream_rl.cli.main`).

Consumes: the resolved config (``trainer.model_dir``, the base, taken from the built demo when left at its
default; the trainer's checkpoint directory), ``--checkpoint`` (default: the newest complete checkpoint there),
``--base`` (default ``trainer.model_dir``) and ``--out``.
Produces: a standalone ``save_pretrained`` directory at ``--out`` (:mod:`consumers.trainer.export`: a LoRA
checkpoint merged into its base) and its path on stdout; exit 2 on an invalid config, no checkpoint, no base or an
existing ``--out`` without ``--overwrite``.
Guarantees: no broker is needed; the output loads with ``AutoModelForCausalLM.from_pretrained`` alone (no
``peft``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stream_rl.cli.common import ConfigOpt, DryRunOpt, SetOpt, fail, resolve


def export(out: Annotated[Path, typer.Option("--out", help="directory to write (save_pretrained layout)")],
           config: ConfigOpt = None, set_: SetOpt = None,
           checkpoint: Annotated[Path | None, typer.Option(
               help="checkpoint directory (step-*, or best/ of trainer.keep_best); default: the newest complete "
                    "step-* of the trainer")] = None,
           base: Annotated[Path | None, typer.Option(
               help="the base model directory the checkpoint was trained from; default: trainer.model_dir")] = None,
           overwrite: Annotated[bool, typer.Option(help="replace an existing --out")] = False,
           dry_run: DryRunOpt = False) -> None:
    """Write a checkpoint's policy as a standalone Hugging Face model directory (LoRA adapters merged)."""
    from stream_rl.cli.run_cmd import apply_demo
    from stream_rl.config.shared import checkpoint_root
    from stream_rl.storage.checkpoint import CheckpointError, latest_checkpoint

    cfg = resolve(config, set_, None, dry_run)
    demo = cfg.run.demo_dir
    if base is None and "model_dir" not in cfg.trainer.model_fields_set and demo is not None \
            and (demo / "policy").is_dir():
        apply_demo(cfg, demo)
    base = base or cfg.trainer.model_dir
    if base is None:
        fail("no base model: pass --base or set trainer.model_dir", 2)
    root = checkpoint_root(cfg.run_dir, cfg.trainer.checkpoint_dir)
    checkpoint = checkpoint or latest_checkpoint(root)
    if checkpoint is None:
        fail(f"no complete checkpoint in {root}: pass --checkpoint", 2)
    from consumers.trainer.export import export_checkpoint

    try:
        path = export_checkpoint(checkpoint, base, out, overwrite=overwrite)
    except (FileExistsError, CheckpointError, ValueError) as exc:
        fail(f"export failed: {exc}", 2)
    typer.echo(str(path))
