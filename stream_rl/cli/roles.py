"""CLI commands that start the pipeline roles: produce, score, train, and `prompts load`, `demo init`.

Each role command resolves the config, installs SIGTERM/SIGINT handlers that ask the loop to stop after its
current batch (outputs flushed and committed), and runs the role's thin loop. Heavy imports happen here, after
the command line is parsed.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from stream_rl.cli.common import BootstrapOpt, ConfigOpt, DryRunOpt, RunOpt, SetOpt, fail, resolve

InstanceOpt = Annotated[int | None, typer.Option("--instance", help="index of this process within its role "
                                                 "(used in its id)")]
prompts_app = typer.Typer(help="Prompt data: load a JSON-lines file onto the prompts topic.", no_args_is_help=True)
demo_app = typer.Typer(help="The built-in demo (tiny model, 2-digit addition, verifier).", no_args_is_help=True)


def setup_logging() -> None:
    """One log line per event on stderr (the run directory's ROLE-N.log under `stream-rl run`)."""
    import logging
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT, so a role finishes its batch and exits cleanly."""
    stop = threading.Event()

    def _handler(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop


def _role_flags(bootstrap: str | None, run: str | None) -> dict:
    return {"kafka.bootstrap_servers": bootstrap, "topics.run": run}


def produce(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
            instance: InstanceOpt = None,
            max_batches: Annotated[int | None, typer.Option(help="stop after this many batches")] = None,
            dry_run: DryRunOpt = False) -> None:
    """Sample groups of rollouts for prompts with the current policy and publish them."""
    flags = _role_flags(bootstrap, run)
    if instance is not None:
        flags["producer.producer_id"] = f"producer-{instance}"
    cfg = resolve(config, set_, flags, dry_run)
    setup_logging()
    from producers.loop import run_producer

    run_producer(cfg, stop_event=stop_on_signals(), max_batches=max_batches)


def score(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
          instance: InstanceOpt = None,
          max_batches: Annotated[int | None, typer.Option(help="stop after this many batches")] = None,
          dry_run: DryRunOpt = False) -> None:
    """Attach rewards and reference logprobs to rollouts and publish scored rollouts."""
    flags = _role_flags(bootstrap, run)
    if instance is not None:
        flags["scorer.scorer_id"] = f"scorer-{instance}"
    cfg = resolve(config, set_, flags, dry_run)
    setup_logging()
    from consumers.scorer.loop import run_scorer

    run_scorer(cfg, stop_event=stop_on_signals(), max_batches=max_batches)


def train(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
          instance: InstanceOpt = None,
          resume: Annotated[bool, typer.Option(help="continue from the newest complete checkpoint")] = False,
          max_steps: Annotated[int | None, typer.Option(help="trainer.max_steps")] = None,
          dry_run: DryRunOpt = False) -> None:
    """Train on scored rollouts, broadcast weights, checkpoint."""
    flags = {**_role_flags(bootstrap, run), "trainer.max_steps": max_steps}
    cfg = resolve(config, set_, flags, dry_run)
    setup_logging()
    from consumers.trainer.loop import run_trainer

    run_trainer(cfg, stop_event=stop_on_signals(), resume=resume)


@prompts_app.command("load")
def prompts_load(file: Annotated[Path, typer.Argument(help="JSON lines: {prompt_id?, text, answer?, metadata?}")],
                 epochs: Annotated[int, typer.Option(help="passes over the file")] = 1,
                 group_size: Annotated[int, typer.Option(help="samples per prompt")] = 8,
                 seed: Annotated[int, typer.Option(help="shuffle seed (per epoch: seed + epoch)")] = 0,
                 config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None,
                 run: RunOpt = None, dry_run: DryRunOpt = False) -> None:
    """Validate a prompt file, then publish one record per (prompt, epoch); nothing is sent if it is invalid."""
    from stream_rl.prompts import PromptFileError, prompt_messages, publish_prompts, read_prompt_file
    from stream_rl.transport.client import Transport

    cfg = resolve(config, set_, _role_flags(bootstrap, run), dry_run)
    try:
        messages = prompt_messages(read_prompt_file(file), epochs, group_size, seed)
    except PromptFileError as exc:
        fail(str(exc), 2)
    transport = Transport(cfg, "prompts")
    transport.ensure_topics()
    typer.echo(f"published {publish_prompts(transport, messages)} prompts to {transport.names.prompts}")


@demo_app.command("init")
def demo_init(directory: Annotated[Path, typer.Argument(help="where to build the demo")],
              seed: Annotated[int, typer.Option()] = 0,
              reward_model: Annotated[bool, typer.Option(help="also build the tiny reward model")] = True,
              overwrite: Annotated[bool, typer.Option(help="rebuild an existing directory")] = False) -> None:
    """Build the demo: char tokenizer, tiny Llama after a short supervised warm-start, prompts, verifier."""
    import json

    from stream_rl.demo.init import init_demo

    try:
        info = init_demo(directory, seed=seed, reward_model=reward_model, overwrite=overwrite)
    except FileExistsError as exc:
        fail(str(exc), 2)
    typer.echo(json.dumps(info, indent=2, default=str))
