"""`stream-rl run`: broker, topics, prompts, then producers, scorers and the trainer as separate processes.

With ``run.demo_dir`` set (the default), the built-in demo is built there when missing and fills every model, reward
and prompt setting left at its default. The run gets a unique name (topics) and directory unless both are given.
Before anything starts (and with ``--dry-run``, when the prompt file exists) the prompt file is checked as `prompts
validate` checks it, against the configured reward, and a ``producer.vllm.engine_kwargs`` key the installed vLLM
lacks is refused: exit 2 in one line (the prompt file's first errors below it). Exits 0 when the trainer reaches its
step budget, non-zero naming the role when any role dies, 143 after SIGTERM and 130 after Ctrl-C (128 + the signal's
number). However it ends (budget, a role's death, Ctrl-C, SIGTERM), it stops every role it started and the broker if
it started it.
"""

from __future__ import annotations

import json
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
    if cfg.eval is not None and not cfg.eval.sets:  # the demo's held-out split (never trained on)
        cfg.eval.sets = {"heldout": demo_dir / "eval_prompts.jsonl"}
    return cfg


def _name_run(cfg, resume: bool = False) -> None:
    if _is_default(cfg.topics, "run"):
        if resume:
            fail("--resume: name the run to continue with --run NAME", 2)
        cfg.topics.run = f"{cfg.topics.run}-{time.strftime('%Y%m%d-%H%M%S')}"
    if "run_dir" not in cfg.model_fields_set:
        cfg.run_dir = Path("runs") / cfg.topics.run


def _check_reuse(cfg, resume: bool, local_broker: bool) -> None:
    """A run name whose topics already hold records is continued only on purpose (``--resume``), otherwise refused
    in one line (:func:`stream_rl.cli.runs.reuse_refusal`, exit 2); ``--resume`` of a run with no records, too.
    A resume continues in the run directory that wrote the run unless ``run_dir`` is given."""
    from stream_rl.cli.runs import records_on_broker, reuse_refusal, writer_of
    from stream_rl.transport.topics import TopicNames

    counts = records_on_broker(cfg)
    written = sum(counts.values()) > 0
    if written and not resume:
        fail(reuse_refusal(cfg.topics.run, cfg.kafka.bootstrap_servers, counts, TopicNames.from_config(cfg.topics),
                           writer_of(cfg, local_broker)), 2)
    if resume and not written:
        fail(f"--resume: run {cfg.topics.run} has no records on the broker at {cfg.kafka.bootstrap_servers}: "
             f"start it without --resume", 2)
    if resume and "run_dir" not in cfg.model_fields_set:
        cfg.run_dir = writer_of(cfg, local_broker) or cfg.run_dir


def run(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
        max_steps: Annotated[int | None, typer.Option(help="trainer.max_steps")] = None,
        resume: Annotated[bool, typer.Option(help="continue the run named by --run: its prompts, offsets and the "
                                             "trainer's newest checkpoint (a run name that has records on the "
                                             "broker is refused without it)")] = False,
        dry_run: DryRunOpt = False) -> None:
    """Run the whole pipeline on this machine (local broker unless --bootstrap) until the step budget."""
    cfg = resolve(config, set_, {"kafka.bootstrap_servers": bootstrap, "topics.run": run,
                                 "trainer.max_steps": max_steps})
    _name_run(cfg, resume)
    if cfg.run.demo_dir is not None:
        apply_demo(cfg, cfg.run.demo_dir)
    placement = _place(cfg)
    _check_engine_kwargs(cfg)
    if dry_run:
        _dry_run(cfg)
    devices = _gpu_devices(cfg)
    if cfg.trainer.max_steps is None and cfg.run.max_wall_s is None:
        fail("invalid config: trainer.max_steps: set a step budget (or run.max_wall_s) for `stream-rl run`", 2)
    if cfg.run.prompts_file is None:
        fail("invalid config: run.prompts_file: no prompts (set it, or keep run.demo_dir)", 2)
    _build_demo(cfg)
    rows = None if resume else _checked_prompts(cfg).rows  # refused before the broker and the roles start
    from stream_rl import broker

    signal.signal(signal.SIGTERM, _interrupted)  # SIGTERM ends the run as Ctrl-C does: every role, then the broker
    signal.signal(signal.SIGINT, _interrupted)
    started_broker = False
    local_broker = not cfg.kafka.bootstrap_servers
    if local_broker:
        if not cfg.run.start_broker:
            fail("invalid config: kafka.bootstrap_servers: not set and run.start_broker is false", 2)
        started_broker = not broker.status(cfg.broker)[0]
        cfg.kafka.bootstrap_servers = broker.up(cfg.broker).bootstrap
        typer.echo(f"local broker on {cfg.kafka.bootstrap_servers}")
    try:
        _check_reuse(cfg, resume, local_broker)
        if resume:  # its prompts are on the broker already
            typer.echo(f"run {cfg.topics.run}: resuming; run dir {cfg.run_dir}")
        else:
            _load_prompts(cfg, rows)
            if local_broker:
                from stream_rl.cli.runs import record_writer

                record_writer(cfg)
        typer.echo(placement.describe())
        _launch(cfg, placement, resume, devices)
    except KeyboardInterrupt as exc:
        fail("interrupted before the roles started", interrupted_code(exc))
    finally:
        if started_broker:
            broker.down(cfg.broker)


def _dry_run(cfg) -> None:
    """``--dry-run``: refuse a prompt file `run` would refuse (when it exists: the demo's is not built yet), print
    the resolved config on stdout (and the GPU layout on stderr), exit 0."""
    from stream_rl.config.loading import dump_config

    from stream_rl.hubs import source_kind

    if cfg.run.prompts_file is not None and (Path(cfg.run.prompts_file).exists() or source_kind(cfg.run.prompts_file)):
        _checked_prompts(cfg)
    typer.echo(dump_config(cfg))
    if cfg.run.gpus is not None:  # stderr: stdout stays the config's JSON
        typer.echo("\n".join(_gpu_lines(cfg)), err=True)
    raise typer.Exit(0)


class Terminated(KeyboardInterrupt):
    """SIGTERM as an exception. A subclass, so every ``except KeyboardInterrupt`` cleans up as for Ctrl-C, but not
    ``KeyboardInterrupt`` itself, which CPython may turn into a death by SIGINT at exit even when it was caught."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def interrupted_code(exc: BaseException) -> int:
    """Exit code of a run interrupted by ``exc``: 128 + the signal's number, as the roles do (143 for SIGTERM, 130
    for Ctrl-C; a plain KeyboardInterrupt is Ctrl-C)."""
    return 128 + int(getattr(exc, "signum", signal.SIGINT))


def _interrupted(signum, frame) -> None:
    """First SIGTERM or Ctrl-C: interrupt; a further SIGTERM is ignored so the cleanup completes, a further Ctrl-C
    still interrupts it (the supervisor then kills the roles at once)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, _raise_terminated)
    _raise_terminated(signum, frame)


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


def _build_demo(cfg) -> None:
    if cfg.run.demo_dir is not None and not (cfg.run.demo_dir / "policy").is_dir():
        from stream_rl.demo.init import init_demo

        typer.echo(f"building the demo in {cfg.run.demo_dir} (supervised warm-start, about a minute) ...")
        info = init_demo(cfg.run.demo_dir, seed=0)
        typer.echo(f"demo ready: SFT {info.get('sft', {}).get('steps', '?')} steps, sampled accuracy "
                   f"{info.get('sft', {}).get('sampled_accuracy', '?')}")


def _check_engine_kwargs(cfg) -> None:
    """With ``producer.engine = "vllm"`` and vLLM importable, refuse an ``engine_kwargs`` key its ``EngineArgs``
    lacks now (exit 2), not when a producer builds its engine after the broker and the warm-up; the names are read
    in a child process (:func:`producers.engines.vllm_args.engine_arg_names_isolated`)."""
    import importlib.util

    kwargs = cfg.producer.vllm.engine_kwargs
    if cfg.producer.engine != "vllm" or not kwargs or importlib.util.find_spec("vllm") is None:
        return
    from producers.engines.base import EngineError
    from producers.engines.vllm_args import check_engine_kwargs, engine_arg_names_isolated

    try:
        check_engine_kwargs(kwargs, engine_arg_names_isolated())
    except EngineError as exc:
        fail(f"invalid config: {exc}", 2)


def _checked_prompts(cfg):
    """``run.prompts_file`` checked as `prompts load` checks it: ``cfg.data`` (layout, mapping), conversational
    prompts rendered with the policy's chat template (``producer.model_dir``), no dedup, and against the reward
    (:func:`stream_rl.cli.roles_cmd.reward_plan`); exit 2 naming the first errors, warnings on stderr."""
    from stream_rl.cli.roles_cmd import reward_plan
    from stream_rl.prompts import PromptFileError, check_options, check_prompt_file

    try:
        options = check_options(cfg.data, policy_dir=cfg.producer.model_dir, dedup="none", reward=reward_plan(cfg))
        report = check_prompt_file(cfg.run.prompts_file, options)
    except (PromptFileError, ValueError) as exc:
        fail(f"run.prompts_file: {exc}", 2)
    if not report.valid:
        fail(f"run.prompts_file {cfg.run.prompts_file} is invalid, nothing started (`stream-rl prompts validate` "
             f"shows the whole report):\n{report.error_summary()}", 2)
    for problem in report.warnings[:10]:
        typer.echo(f"warning: {problem.render(report.path, report.unit)}", err=True)
    return report


def _load_prompts(cfg, rows) -> None:
    """Topics, then one Prompt record per (prompt, epoch) of the checked ``rows`` (:func:`_checked_prompts`)."""
    from stream_rl.prompts import prompt_messages, publish_prompts
    from stream_rl.transport.client import Transport

    transport = Transport(cfg, "run")
    transport.ensure_topics()
    messages = prompt_messages(rows, cfg.run.epochs, cfg.run.group_size)
    typer.echo(f"run {cfg.topics.run}: {publish_prompts(transport, messages)} prompts loaded; "
               f"run dir {cfg.run_dir}")


def _place(cfg):
    """The run's :class:`~stream_rl.launch.placement.Placement`; with ``run.placement = "auto"`` and
    ``topics.partitions`` not set by the user, the data topics get one partition per consumer."""
    from stream_rl.launch import placement

    if cfg.run.placement != "none" and "partitions" not in cfg.topics.model_fields_set:
        cfg.topics.partitions = placement.sized_partitions(cfg.topics.partitions, cfg.run.producers,
                                                           cfg.run.scorers)
    return placement.plan(placement.usable_cores(), cfg.run.trainer_ranks, cfg.run.placement)


def _pin_all(sup, chosen) -> None:
    """Apply the placement to every role (a trainer's ranks included)."""
    from stream_rl.launch.placement import pin_tree

    for child in sup.children:
        role = child.role.rsplit("-", 1)[0]
        pin_tree(child.proc.pid, chosen.cores["produce" if role in ("evaluate", "gateway", "drive") else role])


def _gpu_lines(cfg) -> list[str]:
    """The GPU layout ``--dry-run`` prints (:func:`stream_rl.launch.gpus.describe`)."""
    from stream_rl.cli.config import gpu_counts
    from stream_rl.launch.gpus import describe

    return describe(cfg.run.gpus, gpu_counts(cfg))


def _gpu_devices(cfg) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` per process (``produce-0``, ``train-0``, ...) from ``run.gpus``; with
    ``run.gpus.count`` unset the GPUs torch sees are counted first and an index beyond them is refused (exit 2)."""
    import os

    from stream_rl.cli.config import gpu_counts
    from stream_rl.launch.gpus import assign, layout_errors, visible_devices

    layout, counts = cfg.run.gpus, gpu_counts(cfg)
    if layout is None:
        return {}
    if layout.count is None:
        import torch

        errors = layout_errors(layout, counts, torch.cuda.device_count())
        if errors:
            fail(f"invalid config: {errors[0][1]}", 2)
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {process: visible_devices(gpus, parent) for process, gpus in assign(layout, counts).items()}


def _launch(cfg, chosen, resume: bool = False, devices: dict[str, str] | None = None) -> None:
    from stream_rl.launch.orchestrator import RoleDied, Supervisor, supervise, write_run_config

    servers = _start_servers(cfg)
    config_file = write_run_config(cfg, Path(cfg.run_dir))
    sup = Supervisor(Path(cfg.run_dir), config_file)
    ranks = cfg.run.trainer_ranks
    metrics = Path(cfg.run_dir) / "metrics.jsonl"
    gpus = (devices or {}).get  # process -> CUDA_VISIBLE_DEVICES (None: the environment's)
    try:
        try:
            args = (["--nproc", str(ranks)] if ranks > 1 else []) + (["--resume"] if resume else [])
            sup.start("train", 0, args, threads=chosen.threads["train"], cuda_devices=gpus("train-0"))
            for i in range(cfg.run.scorers):
                sup.start("score", i, threads=chosen.threads["score"], cuda_devices=gpus(f"score-{i}"))
            for i in range(cfg.run.producers):
                sup.start("produce", i, _server_args(cfg, i, servers), threads=chosen.threads["produce"],
                          cuda_devices=gpus(f"produce-{i}"))
            if cfg.eval is not None:  # held-out evaluation: its own process, placed with the producers
                sup.start("evaluate", 0, _eval_args(cfg), threads=chosen.threads["produce"],
                          cuda_devices=gpus("evaluate-0"))
            if cfg.gateway is not None:  # black-box agents' OpenAI endpoint (docs/agents.md), placed with the producers
                sup.start("gateway", 0, _server_args(cfg, cfg.run.producers, servers),
                          threads=chosen.threads["produce"], cuda_devices=gpus("gateway-0"))
            if cfg.driver is not None:  # verifiers environments played through that gateway (docs/agents.md)
                sup.start("drive", 0, ["--stay"], threads=1, cuda_devices="")
        except BaseException:
            sup.stop_all()  # a signal between two starts: the roles already started are stopped, not orphaned
            _stop_servers(servers)
            raise
        # pinned once training has started: three processes importing torch load fastest where the kernel puts them
        rows = supervise(sup, metrics, typer.echo, cfg.run.max_wall_s, poll_s=0.5,
                         on_first_row=lambda: _pin_all(sup, chosen))
    except RoleDied as exc:
        fail(f"run failed: {exc}")
    except KeyboardInterrupt as exc:
        fail("interrupted; every role was stopped", interrupted_code(exc))
    finally:
        _stop_servers(servers)
    typer.echo(summarize(rows))
    if cfg.eval is not None:
        from stream_rl.evaluation.ledger import FILE_NAME, read_rows
        from stream_rl.evaluation.report import before_after_line

        typer.echo(before_after_line(read_rows(Path(cfg.run_dir) / FILE_NAME)))


def _start_servers(cfg) -> list:
    """``[run.servers]``: start the inference servers, wait until each answers, write each producer's URL file
    (``run_dir/servers-I.urls``); versions go through ``run_dir/server-weights`` unless
    ``producer.server.weights_dir`` is set."""
    if cfg.run.servers is None:
        return []
    from stream_rl.launch.orchestrator import die_with_parent
    from stream_rl.launch.servers import ServerStartError, share, start_servers, wait_ready, write_urls_file

    run_dir = Path(cfg.run_dir)
    spec = cfg.run.servers
    typer.echo(f"starting {spec.count} inference server(s) (logs: {run_dir / 'logs'}/server-N.log)")
    servers = start_servers(spec, Path(cfg.producer.model_dir), cfg.producer.dtype, run_dir / "logs",
                            preexec_fn=die_with_parent)
    try:
        wait_ready(servers, spec.startup_timeout_s)
    except BaseException as exc:
        _stop_servers(servers)
        if isinstance(exc, ServerStartError):
            fail(str(exc))
        raise
    drivers = cfg.run.producers + (1 if cfg.gateway is not None else 0)  # the gateway drives its own share
    for i, urls in enumerate(share([s.url for s in servers], drivers)):
        write_urls_file(run_dir / f"servers-{i}.urls", urls)
    (run_dir / "servers.json").write_text(json.dumps(
        [{"url": s.url, "pid": s.proc.pid, "log": str(s.log)} for s in servers], indent=1) + "\n")
    if cfg.producer.server.weights_dir is None:
        cfg.producer.server.weights_dir = run_dir / "server-weights"
        cfg.producer.server.weights_dir.mkdir(parents=True, exist_ok=True)
    return servers


def _server_args(cfg, index: int, servers: list) -> list[str]:
    """Producer ``index``'s own URL file (the gateway's: index ``run.producers``), when `run` started the
    servers."""
    if not servers:
        return []
    return ["--set", f"producer.server.urls_file={Path(cfg.run_dir) / f'servers-{index}.urls'}"]


def _eval_args(cfg) -> list[str]:
    """The evaluator generates in-process (``hf``) when the producers use servers: a server holds one producer's
    version, and the evaluator walks versions of its own (docs/operations.md)."""
    return ["--set", "producer.engine=hf"] if cfg.producer.engine == "server" else []


def _stop_servers(servers: list) -> None:
    if servers:
        from stream_rl.launch.servers import stop_servers

        stop_servers(servers)


def summarize(rows: list[dict]) -> str:
    """First-10% vs last-10% mean reward over the trainer's steps."""
    rewards = [r["reward/mean"] for r in rows if isinstance(r.get("reward/mean"), (int, float))]
    if not rewards:
        return "no trainer steps recorded"
    k = max(1, len(rewards) // 10)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return (f"{len(rewards)} steps: mean reward first 10% {first:.3f}, last 10% {last:.3f} "
            f"(change {last - first:+.3f})")
