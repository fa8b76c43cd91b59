"""``stream-rl demo chat-model DIR``: write the tiny chat model (:mod:`stream_rl.demo.chat_model`) to try the chat
path (``configs/chat_cpu.toml``, multi-turn environments) with no download.

Consumes: a directory that does not exist yet (or ``--overwrite``), a seed. Produces: a ``save_pretrained``
directory (safetensors weights, tokenizer with its ChatML template) and one line naming it and how to use it.
Guarantees: an existing directory is refused (exit 2) before torch is imported, unless ``--overwrite``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated

import typer

from stream_rl.cli.common import fail


def chat_model(directory: Annotated[Path, typer.Argument(help="where to write the model (save_pretrained layout)")],
               seed: Annotated[int, typer.Option(help="weights' random seed")] = 0,
               overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing directory")] = False,
               dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would be written and exit")] = False,
               ) -> None:
    """Write a tiny chat model (ChatML template, turns that end) for trying the chat path on CPU."""
    if dry_run:
        typer.echo(json.dumps({"directory": str(directory), "seed": seed, "overwrite": overwrite,
                               "exists": directory.exists()}))
        raise typer.Exit(0)
    if directory.exists() and not overwrite:
        fail(f"demo chat-model: {directory} already exists: pass --overwrite to replace it, or choose another "
             "directory", 2)
    if directory.exists():
        shutil.rmtree(directory)
    from stream_rl.demo.chat_model import build_chat_model_dir

    build_chat_model_dir(directory, seed=seed)
    typer.echo(f"tiny chat model in {directory}: use it as producer.model_dir and trainer.model_dir "
               f"(e.g. with configs/chat_cpu.toml)")
