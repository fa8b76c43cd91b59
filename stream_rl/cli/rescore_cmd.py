"""`stream-rl rescore`: score a run's logged rollouts again with another reward, into a new run or topic.

A thin wrapper around :mod:`consumers.scorer.rescore`: resolve the config (the run's scorer settings, the demo's
defaults as `stream-rl score` takes them), plan and check the options before the broker is contacted (``--dry-run``
prints the plan as JSON), then run the rescore and print one summary line. A refused option is one line naming it,
exit 2; a broker that is gone, a range that stalls or a refused commit is one line, exit 1; stopped by
SIGINT/SIGTERM after a committed batch: the summary on stderr, exit 128 + the signal's number (130 for Ctrl-C, 143
for SIGTERM, as every role; ``--append`` continues it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from stream_rl.cli.common import BootstrapOpt, ConfigOpt, SetOpt, fail, require_broker, resolve


def _config(config: Path | None, sets: list[str] | None, bootstrap: str | None, dry_run: bool):
    """The resolved config with the built demo's defaults applied, as `stream-rl score` has them."""
    from stream_rl.cli.run_cmd import apply_demo

    cfg = resolve(config, sets, {"kafka.bootstrap_servers": bootstrap})
    demo = cfg.run.demo_dir
    if demo is not None and ((demo / "policy").is_dir() or dry_run):
        apply_demo(cfg, demo)
    return cfg


def rescore(
        to_run: Annotated[str | None, typer.Option(help="new run whose scored topic ({prefix}.{run}.scored) receives "
                                                   "the rescored rollouts; its topics are created")] = None,
        to_topic: Annotated[str | None, typer.Option(help="explicit new scored topic instead (dead letters go to "
                                                     "TOPIC.dlq)")] = None,
        from_run: Annotated[str | None, typer.Option(help="the run whose rollouts are read (default: "
                                                     "topics.run)")] = None,
        reward: Annotated[str | None, typer.Option(help="reward function: a builtin (exact_match, contains_answer, "
                                                   "last_number_match), package.module:function, or none "
                                                   "(default: scorer.reward_fn)")] = None,
        reward_model: Annotated[str | None, typer.Option(help="reward model directory, or none (default: "
                                                         "scorer.reward_model_dir)")] = None,
        from_offset: Annotated[str, typer.Option(help="first offset: earliest, N (every partition) or P:N,P:N")
                               ] = "earliest",
        until_offset: Annotated[str, typer.Option(help="stop before: end (the high-water marks at start), N or "
                                                  "P:N,P:N")] = "end",
        group: Annotated[str | None, typer.Option(help="consumer group that commits the progress (default: "
                                                  "{target scored topic}.rescore)")] = None,
        append: Annotated[bool, typer.Option("--append", help="write into a target that already holds records, "
                                             "continuing from the group's committed offsets")] = False,
        config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan and exit")] = False) -> None:
    """Score a run's rollouts again (a new reward function or reward model) into a new run's scored topic, in a
    consumer group of its own, without touching the source run. Stops at the offsets seen at start."""
    from consumers.scorer.rescore import RescoreError, plan_rescore

    cfg = _config(config, set_, bootstrap, dry_run)
    try:
        plan = plan_rescore(cfg, cfg.scorer, from_run=from_run, to_run=to_run, to_topic=to_topic, group=group,
                            reward=reward, reward_model=Path(reward_model) if reward_model is not None else None,
                            from_offset=from_offset, until_offset=until_offset, append=append)
    except RescoreError as exc:
        fail(f"rescore: {exc}", 2)
    if dry_run:
        typer.echo(json.dumps(plan.describe(), indent=2))
        raise typer.Exit(0)
    require_broker(cfg)
    _run(cfg, plan)


def _run(cfg, plan) -> None:
    from consumers.scorer.rescore import RescoreError, run_rescore, summary
    from stream_rl.cli.roles_cmd import run_role, setup_logging, stop_on_signals
    from stream_rl.transport.ranges import RangeError

    setup_logging()
    stop, done = stop_on_signals(), []

    def job(cfg_, plan_) -> None:
        try:
            done.append(run_rescore(cfg_, plan_, stop))
        except RescoreError as exc:
            fail(f"rescore: {exc}", 2)
        except RangeError as exc:
            fail(f"rescore: {plan_.source_topic}: {exc}")

    run_role(job, cfg, plan)
    stats = done[0]
    if not stats.complete:
        fail(summary(plan, stats), 128 + (stop.signum or 2))
    typer.echo(summary(plan, stats))
