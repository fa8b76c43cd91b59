"""CLI commands that start the pipeline roles: produce, score, train, and `prompts validate|load`, `demo init`.

Each role command resolves the config, fills the model settings left at their defaults from the built demo
(``run.demo_dir``, as `stream-rl run` does; exit 2 in one line when the demo is not built), checks that a broker
answers (one line naming the address, exit 1, when none does), installs SIGTERM/SIGINT handlers that ask the loop
to stop after its current batch (outputs flushed and committed), and runs the role's thin loop. Heavy imports
happen here, after the command line is parsed.

Exit codes of a role: 0 when it reached its budget (``--max-batches``, ``trainer.max_steps``); after a clean stop
asked by a signal, 128 + the signal's number, the shell's convention for a process ended by that signal (143 for
SIGTERM, 130 for Ctrl-C), so a supervisor can tell "done" from "stopped early" (a trainer rank, stopped by its
launcher, exits 0). Once the loop has returned, further SIGTERM/SIGINT are ignored: the exit completes (no death
by signal during the interpreter's teardown).
"""

from __future__ import annotations

import logging
import signal
import threading
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from stream_rl.cli.common import BootstrapOpt, ConfigOpt, DryRunOpt, RunOpt, SetOpt, fail, require_broker, resolve

InstanceOpt = Annotated[int | None, typer.Option("--instance", help="index of this process within its role "
                                                 "(used in its id)")]
prompts_app = typer.Typer(help="Prompt data: check a JSON-lines or Parquet file, load it onto the prompts topic.",
                          no_args_is_help=True)
demo_app = typer.Typer(help="The built-in demo (tiny model, 2-digit addition, verifier).", no_args_is_help=True)


def setup_logging() -> None:
    """One log line per event on stderr (the run directory's ROLE-N.log under `stream-rl run`)."""
    from stream_rl.cli.errors import debug_enabled
    from stream_rl.runtime.logs import setup_role_logging

    setup_role_logging(debug=debug_enabled())  # library noise stays out of role logs unless --debug


class StopRequest(threading.Event):
    """Set by SIGTERM or SIGINT; ``signum`` is the first signal that set it (None: not set by a signal)."""

    signum: int | None = None


def stop_on_signals() -> StopRequest:
    """An event set by SIGTERM or SIGINT, so a role finishes its batch and exits cleanly."""
    stop = StopRequest()

    def _handler(signum, frame):
        if stop.signum is None:
            stop.signum = signum
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop


def run_role(fn, cfg, *args, **kwargs) -> None:
    """Run a role loop; an alert with action ``stop`` ends the process with exit code 3 (after its checkpoint).
    The failures an operator acts on (the broker lost, a group that never settles, a missing topic, offsets the
    broker no longer has, an unacknowledged send) end it with one line naming the broker, exit code 1."""
    from consumers.trainer.positions import OffsetLossError
    from stream_rl.alerts.monitor import AlertStop
    from stream_rl.transport.edge import BrokerUnreachable, DeliveryError
    from stream_rl.transport.membership import NoAssignment
    from stream_rl.transport.topics import TopicError

    try:
        fn(cfg, *args, **kwargs)
        _exit_after_signal(kwargs.get("stop_event"))
    except AlertStop as exc:
        typer.echo(f"stopped by alert: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except (BrokerUnreachable, NoAssignment, TopicError, OffsetLossError, DeliveryError) as exc:
        logging.getLogger("stream_rl.cli").error("%s: %s", type(exc).__name__, exc)
        fail(f"{type(exc).__name__} (broker {cfg.kafka.bootstrap_servers or 'the local broker'}): {exc}")


def _exit_after_signal(stop: StopRequest | None) -> None:
    """The loop returned: ignore further SIGTERM/SIGINT (the exit completes), and exit 128 + the signal's number
    when a signal stopped it (module docstring)."""
    from consumers.trainer.launch import running_as_rank

    if threading.current_thread() is threading.main_thread():  # a role run on a thread (tests) has no handlers
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an ignored signal stays ignored through the teardown
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signum = getattr(stop, "signum", None)
    if signum is not None and not running_as_rank():
        raise typer.Exit(128 + signum)


def _role_flags(bootstrap: str | None, run: str | None) -> dict:
    return {"kafka.bootstrap_servers": bootstrap, "topics.run": run}


DEMO_NEEDS = {"produce": ("producer", "model_dir", True), "train": ("trainer", "model_dir", True),
              "score": ("scorer", "reference_model_dir", False)}
"""The setting each role takes from the demo when it is left at its default, and whether the role needs it set
when there is no demo (``run.demo_dir`` null): a scorer may run without a reference model."""


def role_config(config, sets, flags: dict, dry_run: bool, role: str):
    """The role's resolved config, its model settings at their defaults taken from the built demo (as `run` does;
    ``--dry-run`` shows them even before the demo is built); then the broker must answer."""
    from stream_rl.cli.run_cmd import apply_demo
    from stream_rl.config.loading import dump_config

    cfg = resolve(config, sets, flags)
    demo = cfg.run.demo_dir
    section, name, needed = DEMO_NEEDS[role]
    if demo is not None and ((demo / "policy").is_dir() or dry_run):
        apply_demo(cfg, demo)
    elif name not in getattr(cfg, section).model_fields_set and (demo is not None or needed):
        where = f"the demo is not built in {demo}" if demo is not None else "run.demo_dir is null"
        build = f"build it with `stream-rl demo init {demo}` (or `make run`), or " if demo is not None else ""
        fail(f"{section}.{name} is not set and {where}: {build}set {section}.{name}"
             + ("" if needed else " (null: none)"), 2)
    if dry_run:
        typer.echo(dump_config(cfg))
        raise typer.Exit(0)
    require_broker(cfg)
    return cfg


def produce(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
            instance: InstanceOpt = None,
            max_batches: Annotated[int | None, typer.Option(help="stop after this many batches")] = None,
            dry_run: DryRunOpt = False) -> None:
    """Sample groups of rollouts for prompts with the current policy and publish them."""
    flags = _role_flags(bootstrap, run)
    if instance is not None:
        flags["producer.producer_id"] = f"producer-{instance}"
    cfg = role_config(config, set_, flags, dry_run, "produce")
    setup_logging()
    from producers.role import run_producer

    run_role(run_producer, cfg, cfg.producer, stop_event=stop_on_signals(), max_batches=max_batches)


def score(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
          instance: InstanceOpt = None,
          max_batches: Annotated[int | None, typer.Option(help="stop after this many batches")] = None,
          dry_run: DryRunOpt = False) -> None:
    """Attach rewards and reference logprobs to rollouts and publish scored rollouts."""
    flags = _role_flags(bootstrap, run)
    if instance is not None:
        flags["scorer.scorer_id"] = f"scorer-{instance}"
    cfg = role_config(config, set_, flags, dry_run, "score")
    setup_logging()
    from consumers.scorer.scorer import run_scorer

    run_role(run_scorer, cfg, cfg.scorer, stop_event=stop_on_signals(), max_batches=max_batches)


NprocOpt = Annotated[int, typer.Option(min=1, help="data-parallel trainer ranks on this machine (torchrun's "
                                       "--nproc-per-node); gloo on CPU, NCCL on CUDA")]
NnodesOpt = Annotated[int, typer.Option(min=1, help="machines in the job; each runs this same command")]
RdzvOpt = Annotated[str | None, typer.Option(help="HOST:PORT of the rendezvous (one of the machines), the same on "
                                             "every machine; needed with --nnodes > 1")]


def train(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
          instance: InstanceOpt = None,
          resume: Annotated[bool, typer.Option(help="continue from the newest complete checkpoint")] = False,
          max_steps: Annotated[int | None, typer.Option(help="trainer.max_steps")] = None,
          nproc: NprocOpt = 1, nnodes: NnodesOpt = 1, rdzv_endpoint: RdzvOpt = None,
          dry_run: DryRunOpt = False) -> None:
    """Train on scored rollouts, broadcast weights, checkpoint (on one rank, or N per machine with --nproc)."""
    flags = {**_role_flags(bootstrap, run), "trainer.max_steps": max_steps}
    if nnodes > 1 and not rdzv_endpoint:
        fail("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every machine)", 2)
    cfg = role_config(config, set_, flags, dry_run, "train")
    setup_logging()
    if nproc > 1 or nnodes > 1:
        _launch_ranks(cfg, resume, nproc, nnodes, rdzv_endpoint, instance)
        return
    from consumers.trainer.launch import exit_rank_cleanly, record_errors, running_as_rank
    from consumers.trainer.trainer import run_trainer
    from stream_rl.cli.config import agreements

    run_role(record_errors(run_trainer), cfg, cfg.trainer, stop_event=stop_on_signals(), resume=resume,
             agreements=agreements(cfg))
    if running_as_rank():
        exit_rank_cleanly()


def _launch_ranks(cfg, resume: bool, nproc: int, nnodes: int, rdzv_endpoint: str | None,
                  instance: int | None) -> None:
    """Every rank reads one resolved config file (``run_dir/trainer-ranks.yaml``); the first failure is one line."""
    from consumers.trainer.launch import RankDied, launch_ranks
    from stream_rl.launch.orchestrator import write_run_config

    config_file = write_run_config(cfg, Path(cfg.run_dir), filename="trainer-ranks.yaml")
    args = ["train", "--config", str(config_file), *(["--resume"] if resume else []),
            *(["--instance", str(instance)] if instance is not None else [])]
    try:
        launch_ranks(args, nproc=nproc, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, run_id=cfg.topics.run)
    except RankDied as exc:
        fail(f"{exc}; continue with: stream-rl train --resume --nproc {nproc}"
             + (f" --nnodes {nnodes} --rdzv-endpoint {rdzv_endpoint}" if nnodes > 1 else "")
             + " (logs above name the cause)")


class Dedup(str, Enum):
    exact = "exact"
    normalized = "normalized"
    none = "none"


PromptFileArg = Annotated[Path, typer.Argument(help="JSON lines (.jsonl/.json), Parquet (.parquet) or a datasets "
                                               "save_to_disk directory; plain (text|messages), verl or TRL layout "
                                               "(docs/prompts.md)")]
DedupOpt = Annotated[Dedup, typer.Option(help="drop later rows with the same prompt_id or text (exact), also the "
                                         "same NFKC/casefold/whitespace-normalized text (normalized), or none")]
MinCharsOpt = Annotated[int, typer.Option(min=0, help="drop texts shorter than this (code points)")]
MaxCharsOpt = Annotated[int | None, typer.Option(min=1, help="drop texts longer than this (code points)")]
MaxTokensOpt = Annotated[int | None, typer.Option(min=1, help="drop prompts with more tokens, rendered prompts "
                                                  "included (default: data.max_prompt_tokens)")]
TokenizerOpt = Annotated[Path | None, typer.Option(help="tokenizer directory that renders messages and counts "
                                                   "tokens (default: the policy's, producer.model_dir)")]
StrictOpt = Annotated[bool, typer.Option(help="unknown fields are errors, not warnings")]
PromptKeyOpt = Annotated[str | None, typer.Option(help="column holding the prompt, text or messages "
                                                  "(default: data.prompt_key, else detected)")]
AnswerKeyOpt = Annotated[str | None, typer.Option(help="column holding the answer, dotted for nested "
                                                  "(default: data.answer_key, else detected)")]
IdKeyOpt = Annotated[str | None, typer.Option(help="column holding the prompt id (default: data.id_key, else "
                                              "prompt_id or the line/row number)")]
MetadataKeysOpt = Annotated[str | None, typer.Option(help="comma-separated columns copied into the metadata tags "
                                                     "(default: data.metadata_keys, else data_source, ability, "
                                                     "extra_info when present)")]


def _policy_dir(cfg) -> Path:
    """The policy whose tokenizer renders messages: producer.model_dir, or the built demo's as `run` resolves it."""
    demo = cfg.run.demo_dir
    if "model_dir" not in cfg.producer.model_fields_set and demo is not None and (demo / "policy").is_dir():
        return demo / "policy"
    return cfg.producer.model_dir


def reward_plan(cfg):
    """What will score the prompts (:class:`stream_rl.prompts.RewardPlan`): ``scorer.rewards`` routes, else
    ``scorer.reward_fn``; the file is checked against it (answers a verifier needs, routes)."""
    from stream_rl.prompts import RewardPlan

    rewards = cfg.scorer.rewards
    return RewardPlan(cfg.scorer.reward_fn, rewards.to_routes() if rewards is not None else None)


def _check_prompts(file: Path, cfg, flags: dict):
    """The report on ``file`` with these flags over ``cfg.data``, checked against the configured reward; exit 2
    for bad options or a missing or unknown file (or tokenizer)."""
    from stream_rl.prompts import PromptFileError, check_options, check_prompt_file, mapping_of

    flags = dict(flags)
    keys = flags.pop("metadata_keys")
    metadata = None if keys is None else [k.strip() for k in keys.split(",") if k.strip()]
    mapping = mapping_of(cfg.data, flags.pop("prompt_key"), flags.pop("answer_key"), flags.pop("id_key"), metadata)
    try:
        options = check_options(cfg.data, policy_dir=_policy_dir(cfg), mapping=mapping, reward=reward_plan(cfg),
                                **flags)
        return check_prompt_file(file, options)
    except (PromptFileError, ValueError) as exc:  # bad options, a missing file, an unknown format or column
        fail(f"prompts: {exc}", 2)


def _flags(dedup: Dedup, min_chars, max_chars, max_tokens, tokenizer, strict, prompt_key, answer_key, id_key,
           metadata_keys) -> dict:
    return {"dedup": dedup.value, "min_chars": min_chars, "max_chars": max_chars, "max_tokens": max_tokens,
            "tokenizer": tokenizer, "strict": strict, "prompt_key": prompt_key, "answer_key": answer_key,
            "id_key": id_key, "metadata_keys": metadata_keys}


@prompts_app.command("validate")
def prompts_validate(file: PromptFileArg, dedup: DedupOpt = Dedup.exact, min_chars: MinCharsOpt = 1,
                     max_chars: MaxCharsOpt = None, max_tokens: MaxTokensOpt = None, tokenizer: TokenizerOpt = None,
                     strict: StrictOpt = False, prompt_key: PromptKeyOpt = None, answer_key: AnswerKeyOpt = None,
                     id_key: IdKeyOpt = None, metadata_keys: MetadataKeysOpt = None,
                     json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
                     limit: Annotated[int, typer.Option(min=1, help="entries listed per section (text)")] = 20,
                     show: Annotated[int, typer.Option(min=0, help="also print the first N kept prompts exactly as "
                                                       "the producer will tokenize them (decoded ids), with their "
                                                       "answer and data source")] = 0,
                     config: ConfigOpt = None, set_: SetOpt = None, dry_run: DryRunOpt = False) -> None:
    """Check a prompt file as `prompts load` would: layout, stats, dropped rows, errors by line. Exit 0 valid, 2 not.

    Conversational prompts (messages) are rendered with the chat template, as `load` publishes them. The file is
    checked against the configured reward (scorer.rewards / scorer.reward_fn): answers a verifier needs, routes.
    """
    import json

    cfg = resolve(config, set_, dry_run=dry_run)  # --dry-run prints it ([data] and producer.model_dir) and exits
    from stream_rl.prompts import render_report
    from stream_rl.prompts.options import tokenizer_source
    from stream_rl.prompts.show import render_shown, shown_prompts

    report = _check_prompts(file, cfg, _flags(dedup, min_chars, max_chars, max_tokens, tokenizer, strict, prompt_key,
                                              answer_key, id_key, metadata_keys))
    shown = shown_prompts(report.rows, show, tokenizer_source(tokenizer, _policy_dir(cfg))) if show else []
    if json_out:
        typer.echo(json.dumps({**report.to_dict(), **({"shown": [s.to_dict() for s in shown]} if show else {})},
                              indent=2))
    else:
        typer.echo(render_report(report, limit))
        if shown:
            typer.echo(render_shown(shown, report.unit, len(report.rows)))
    raise typer.Exit(0 if report.valid else 2)


@prompts_app.command("load")
def prompts_load(file: PromptFileArg,
                 epochs: Annotated[int, typer.Option(help="passes over the file")] = 1,
                 group_size: Annotated[int, typer.Option(help="samples per prompt")] = 8,
                 seed: Annotated[int, typer.Option(help="shuffle seed (epoch e uses seed + e)")] = 0,
                 shuffle: Annotated[bool, typer.Option(help="shuffle each epoch (else file order)")] = True,
                 dedup: DedupOpt = Dedup.exact, min_chars: MinCharsOpt = 1, max_chars: MaxCharsOpt = None,
                 max_tokens: MaxTokensOpt = None, tokenizer: TokenizerOpt = None, strict: StrictOpt = False,
                 prompt_key: PromptKeyOpt = None, answer_key: AnswerKeyOpt = None, id_key: IdKeyOpt = None,
                 metadata_keys: MetadataKeysOpt = None,
                 config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None,
                 run: RunOpt = None, dry_run: DryRunOpt = False) -> None:
    """Check the whole file, render messages, filter and dedup, then publish one record per (prompt, epoch).

    Nothing is published when the file has an error: exit 2 naming the first errors with their line numbers.
    """
    from stream_rl.prompts import PromptFileError, prompt_messages, publish_prompts
    from stream_rl.transport.client import Transport

    cfg = resolve(config, set_, _role_flags(bootstrap, run), dry_run)
    report = _check_prompts(file, cfg, _flags(dedup, min_chars, max_chars, max_tokens, tokenizer, strict, prompt_key,
                                              answer_key, id_key, metadata_keys))
    if not report.valid:
        fail(f"prompts load: {file} is invalid, nothing published:\n{report.error_summary()}", 2)
    try:
        messages = prompt_messages(report.rows, epochs, group_size, seed, shuffle)
    except PromptFileError as exc:
        fail(f"prompts load: {exc}, nothing published", 2)
    st = report.stats
    dropped = ", ".join(f"{reason} {n}" for reason, n in sorted(st.dropped.items())) or "none"
    rendered = sum(row.conversational for row in report.rows)
    typer.echo(f"{file} ({report.layout.name} layout): {st.rows} {report.unit}s, {st.valid} valid, {st.kept} kept "
               f"(dropped: {dropped}), {rendered} rendered by the chat template; {len(report.warnings)} warnings")
    require_broker(cfg)
    transport = Transport(cfg, "prompts")
    transport.ensure_topics()
    sent = publish_prompts(transport, messages)
    typer.echo(f"published {sent} prompts ({st.kept} x {epochs} epochs, group size {group_size}) to "
               f"{transport.names.prompts}")


@demo_app.command("init")
def demo_init(directory: Annotated[Path, typer.Argument(help="where to build the demo")],
              seed: Annotated[int, typer.Option()] = 0,
              reward_model: Annotated[bool, typer.Option(help="also build the tiny reward model")] = True,
              overwrite: Annotated[bool, typer.Option("--overwrite", help="rebuild an existing directory")] = False,
              dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would be built and exit "
                                                    "(exit 2 if the directory exists without --overwrite)")] = False
              ) -> None:
    """Build the demo: char tokenizer, tiny Llama after a short supervised warm-start, prompts, verifier."""
    import json

    exists = f"demo init: {directory} already exists: pass --overwrite to rebuild it, or choose another directory"
    if directory.exists() and not overwrite:  # refused before torch is imported
        fail(exists, 2)
    if dry_run:
        typer.echo(json.dumps({"directory": str(directory), "seed": seed, "reward_model": reward_model,
                               "overwrite": overwrite, "exists": directory.exists()}, indent=2))
        raise typer.Exit(0)
    import contextlib
    import sys

    from stream_rl.demo.init import init_demo

    try:  # stdout carries the JSON alone: a library that prints while the demo builds (DeepSpeed's logger, loaded
        with contextlib.redirect_stdout(sys.stderr):  # by transformers where deepspeed is installed) goes to stderr
            info = init_demo(directory, seed=seed, reward_model=reward_model, overwrite=overwrite)
    except FileExistsError:
        fail(exists, 2)
    typer.echo(json.dumps(info, indent=2, default=str))
