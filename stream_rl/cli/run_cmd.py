"""`stream-rl run`: broker, topics, prompts, then producers, scorers and the trainer as separate processes.

With ``run.demo_dir`` set (the default), the built-in demo is built there when missing and fills every model,
reward and prompt setting left at its default. The run gets a unique name (topics) and directory unless both are
given. Exits 0 when the trainer reaches its step budget, non-zero naming the role when any role dies. However it
ends (budget, a role's death, Ctrl-C, SIGTERM), it stops every role it started and the broker if it started it.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Annotated

import typer

from stream_rl.cli.common import BootstrapOpt, ConfigOpt, DryRunOpt, RunOpt, SetOpt, fail, resolve

DEMO_REWARD_FN = "stream_rl.demo.task:addition_reward"


def _is_default(section, name: str) -> bool:
    return name not in section.model_fields_set


def apply_demo(cfg, demo_dir: Path):
    """Point every model/reward/prompt setting still at its default to the demo's files; the reference model only
    when the trainer consumes reference logprobs (``trainer.kl.needs_reference``): no reference forward pass
    otherwise."""
    if _is_default(cfg.producer, "model_dir"):
        cfg.producer.model_dir = demo_dir / "policy"
    if _is_default(cfg.trainer, "model_dir"):
        cfg.trainer.model_dir = demo_dir / "policy"
    if _is_default(cfg.scorer, "reward_fn"):
        cfg.scorer.reward_fn = DEMO_REWARD_FN
    if _is_default(cfg.scorer, "reference_model_dir") and cfg.trainer.kl.needs_reference:
        cfg.scorer.reference_model_dir = demo_dir / "reference"  # else nothing consumes reference logprobs
    if _is_default(cfg.run, "prompts_file"):
        cfg.run.prompts_file = demo_dir / "prompts.jsonl"
    return cfg


def _name_run(cfg) -> None:
    if _is_default(cfg.topics, "run"):
        cfg.topics.run = f"{cfg.topics.run}-{time.strftime('%Y%m%d-%H%M%S')}"
    if "run_dir" not in cfg.model_fields_set:
        cfg.run_dir = Path("runs") / cfg.topics.run


def run(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
        max_steps: Annotated[int | None, typer.Option(help="trainer.max_steps")] = None,
        dry_run: DryRunOpt = False) -> None:
    """Run the whole pipeline on this machine (local broker unless --bootstrap) until the step budget."""
    cfg = resolve(config, set_, {"kafka.bootstrap_servers": bootstrap, "topics.run": run,
                                 "trainer.max_steps": max_steps})
    _name_run(cfg)
    if cfg.run.demo_dir is not None:
        apply_demo(cfg, cfg.run.demo_dir)
    placement = _place(cfg)
    if dry_run:
        from stream_rl.config.loading import dump_config

        typer.echo(dump_config(cfg))
        raise typer.Exit(0)
    if cfg.trainer.max_steps is None and cfg.run.max_wall_s is None:
        fail("invalid config: trainer.max_steps: set a step budget (or run.max_wall_s) for `stream-rl run`", 2)
    if cfg.run.prompts_file is None:
        fail("invalid config: run.prompts_file: no prompts (set it, or keep run.demo_dir)", 2)
    _build_demo(cfg)
    from stream_rl import broker

    signal.signal(signal.SIGTERM, _interrupted)  # SIGTERM ends the run as Ctrl-C does: every role, then the broker
    signal.signal(signal.SIGINT, _interrupted)
    started_broker = False
    if not cfg.kafka.bootstrap_servers:
        if not cfg.run.start_broker:
            fail("invalid config: kafka.bootstrap_servers: not set and run.start_broker is false", 2)
        started_broker = not broker.status(cfg.broker)[0]
        cfg.kafka.bootstrap_servers = broker.up(cfg.broker).bootstrap
        typer.echo(f"local broker on {cfg.kafka.bootstrap_servers}")
    try:
        _load_prompts(cfg)
        typer.echo(placement.describe())
        _launch(cfg, placement)
    except KeyboardInterrupt:
        fail("interrupted before the roles started", 130)
    finally:
        if started_broker:
            broker.down(cfg.broker)


class Terminated(KeyboardInterrupt):
    """SIGTERM as an exception. A subclass, so every ``except KeyboardInterrupt`` cleans up as for Ctrl-C, but not
    ``KeyboardInterrupt`` itself, which CPython may turn into a death by SIGINT at exit even when it was caught."""


def _interrupted(signum, frame) -> None:
    """First SIGTERM or Ctrl-C: interrupt; a further SIGTERM is ignored so the cleanup completes, a further Ctrl-C
    still interrupts it (the supervisor then kills the roles at once)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, _raise_terminated)
    _raise_terminated(signum, frame)


def _raise_terminated(signum, frame) -> None:
    raise Terminated(f"signal {signum}")


def _build_demo(cfg) -> None:
    if cfg.run.demo_dir is not None and not (cfg.run.demo_dir / "policy").is_dir():
        from stream_rl.demo.init import init_demo

        typer.echo(f"building the demo in {cfg.run.demo_dir} (supervised warm-start, about a minute) ...")
        info = init_demo(cfg.run.demo_dir, seed=0)
        typer.echo(f"demo ready: SFT {info.get('sft', {}).get('steps', '?')} steps, sampled accuracy "
                   f"{info.get('sft', {}).get('sampled_accuracy', '?')}")


def _load_prompts(cfg) -> None:
    """Topics, then one Prompt record per (prompt, epoch)."""
    from stream_rl.prompts import prompt_messages, publish_prompts, read_prompt_file
    from stream_rl.transport.client import Transport

    transport = Transport(cfg, "run")
    transport.ensure_topics()
    messages = prompt_messages(read_prompt_file(cfg.run.prompts_file), cfg.run.epochs, cfg.run.group_size)
    typer.echo(f"run {cfg.topics.run}: {publish_prompts(transport, messages)} prompts loaded; "
               f"run dir {cfg.run_dir}")


def _place(cfg):
    """The run's :class:`~stream_rl.launch.placement.Placement`; with ``run.placement = "auto"`` and
    ``topics.partitions`` not set by the user, the data topics get one partition per consumer."""
    from stream_rl.launch import placement

    if cfg.run.placement == "auto" and "partitions" not in cfg.topics.model_fields_set:
        cfg.topics.partitions = placement.sized_partitions(cfg.topics.partitions, cfg.run.producers,
                                                           cfg.run.scorers)
    return placement.plan(placement.usable_cores(), cfg.run.trainer_ranks, cfg.run.placement)


def _pin_all(sup, chosen) -> None:
    """Apply the placement to every role (a trainer's ranks included)."""
    from stream_rl.launch.placement import pin_tree

    for child in sup.children:
        pin_tree(child.proc.pid, chosen.cores[child.role.rsplit("-", 1)[0]])


def _launch(cfg, chosen) -> None:
    from stream_rl.launch.orchestrator import RoleDied, Supervisor, supervise, write_run_config

    config_file = write_run_config(cfg, Path(cfg.run_dir))
    sup = Supervisor(Path(cfg.run_dir), config_file)
    ranks = cfg.run.trainer_ranks
    metrics = Path(cfg.run_dir) / "metrics.jsonl"
    try:
        try:
            sup.start("train", 0, ["--nproc", str(ranks)] if ranks > 1 else None, threads=chosen.threads["train"])
            for i in range(cfg.run.scorers):
                sup.start("score", i, threads=chosen.threads["score"])
            for i in range(cfg.run.producers):
                sup.start("produce", i, threads=chosen.threads["produce"])
        except BaseException:
            sup.stop_all()  # a signal between two starts: the roles already started are stopped, not orphaned
            raise
        # pinned once training has started: three processes importing torch load fastest where the kernel puts them
        rows = supervise(sup, metrics, typer.echo, cfg.run.max_wall_s, poll_s=0.5,
                         on_first_row=lambda: _pin_all(sup, chosen))
    except RoleDied as exc:
        fail(f"run failed: {exc}")
    except KeyboardInterrupt:
        fail("interrupted; every role was stopped", 130)
    typer.echo(summarize(rows))


def summarize(rows: list[dict]) -> str:
    """First-10% vs last-10% mean reward over the trainer's steps."""
    rewards = [r["reward/mean"] for r in rows if isinstance(r.get("reward/mean"), (int, float))]
    if not rewards:
        return "no trainer steps recorded"
    k = max(1, len(rewards) // 10)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return (f"{len(rewards)} steps: mean reward first 10% {first:.3f}, last 10% {last:.3f} "
            f"(change {last - first:+.3f})")
