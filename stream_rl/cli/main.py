"""The ``stream-rl`` command line: the roles, `run`, the local broker, topics, prompts, replay, rescore, config and
tools (plan, doctor, report, status, trace, gc, bench, export).

Each command resolves the config (defaults < file < ``STREAM_RL_*`` env < ``--set`` < named flags), exits 2 with
one line naming the field when it is invalid, and prints the resolved config with ``--dry-run`` (every command
has it; gc, plan, bench and rescore print their plan or inputs instead). The commands that read a run (replay,
status, topics list, report, trace show, gc) default to the newest run: :mod:`stream_rl.cli.runs`. Heavy imports
(torch, transformers) happen inside the commands that need them, after parsing.
"""

from __future__ import annotations

import contextlib
import json
from typing import Annotated

import typer

from stream_rl.cli import diagnose_cmd, eval_cmd, export_cmd, gc_cmd, plan_cmd, rescore_cmd, roles_cmd, run_cmd, status_cmd
from stream_rl.cli import demo_chat_cmd, drive_cmd, gateway_cmd, reward_server_cmd
from stream_rl.cli.common import BootstrapOpt, ConfigOpt, DryRunOpt, RunOpt, SetOpt, fail, require_broker, resolve
from stream_rl.cli.runs import select_run

app = typer.Typer(help="Asynchronous, streaming RL fine-tuning of LLMs over Kafka.", no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None)
"""``rich_markup_mode=None``: help strings are plain text, so ``[eval]`` or ``[data]`` prints as written (rich markup
would take it for a style tag and drop it); the mode reaches every sub-command (tests/unit/test_cli_help_text.py)."""
broker_app = typer.Typer(help="The embedded local Kafka-protocol broker (tansu).", no_args_is_help=True)
topics_app = typer.Typer(help="The run's topics.", no_args_is_help=True)
app.add_typer(broker_app, name="broker")
app.add_typer(topics_app, name="topics")
app.add_typer(roles_cmd.prompts_app, name="prompts")
app.add_typer(roles_cmd.demo_app, name="demo")
roles_cmd.demo_app.command("chat-model")(demo_chat_cmd.chat_model)
app.command("produce")(roles_cmd.produce)
app.command("score")(roles_cmd.score)
app.command("rescore")(rescore_cmd.rescore)
app.command("train")(roles_cmd.train)
app.command("run")(run_cmd.run)
app.command("plan")(plan_cmd.plan)
app.command("doctor")(diagnose_cmd.doctor)
app.command("report")(diagnose_cmd.report)
app.command("gc")(gc_cmd.gc)
app.command("export")(export_cmd.export)
app.command("evaluate")(eval_cmd.evaluate)
app.command("status")(status_cmd.status)
app.command("reward-server")(reward_server_cmd.reward_server)
app.command("gateway")(gateway_cmd.gateway)
app.command("drive")(drive_cmd.drive)
app.add_typer(status_cmd.trace_app, name="trace")


@broker_app.command("up")
def broker_up(config: ConfigOpt = None, set_: SetOpt = None,
              port: Annotated[int | None, typer.Option(help="port on 127.0.0.1 (default: a free one)")] = None,
              state_dir: Annotated[str | None, typer.Option(help="where the PID and address are kept")] = None,
              dry_run: DryRunOpt = False) -> None:
    """Start the local broker on 127.0.0.1 (or reuse the running one) and print its bootstrap address."""
    from stream_rl import broker

    cfg = resolve(config, set_, {"broker.port": port, "broker.state_dir": state_dir}, dry_run)
    try:
        state = broker.up(cfg.broker)
    except broker.BrokerError as exc:
        fail(f"broker up failed: {exc}")
    typer.echo(state.bootstrap)


@broker_app.command("down")
def broker_down(config: ConfigOpt = None, set_: SetOpt = None,
                state_dir: Annotated[str | None, typer.Option()] = None, dry_run: DryRunOpt = False) -> None:
    """Stop exactly the broker process recorded in the state directory."""
    from stream_rl import broker

    cfg = resolve(config, set_, {"broker.state_dir": state_dir}, dry_run)
    state = broker.down(cfg.broker)
    typer.echo(f"stopped broker PID {state.pid} ({state.bootstrap})" if state else "no broker recorded")


@broker_app.command("status")
def broker_status(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None,
                  state_dir: Annotated[str | None, typer.Option()] = None, dry_run: DryRunOpt = False) -> None:
    """Exit 0 when the broker answers a metadata request, 1 with the reason otherwise."""
    from stream_rl import broker

    cfg = resolve(config, set_, {"broker.state_dir": state_dir}, dry_run)
    ok, message = broker.status(cfg.broker, bootstrap or cfg.kafka.bootstrap_servers)
    if not ok:
        fail(message)
    typer.echo(message)


@topics_app.command("create")
def topics_create(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None,
                  run: RunOpt = None, dry_run: DryRunOpt = False) -> None:
    """Create the run's topics (idempotent) with the configured partition counts."""
    from stream_rl.transport.client import Transport

    cfg = resolve(config, set_, {"kafka.bootstrap_servers": bootstrap, "topics.run": run}, dry_run)
    require_broker(cfg)
    for name, parts in Transport(cfg, "cli").ensure_topics().items():
        typer.echo(f"{name}\t{parts}")


@topics_app.command("list")
def topics_list(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None,
                run: RunOpt = None, all_runs: Annotated[bool, typer.Option("--all", help="every topic")] = False,
                as_json: Annotated[bool, typer.Option("--json")] = False, dry_run: DryRunOpt = False) -> None:
    """The run's topics (default: the newest run; --all: every topic) with partition and record counts
    (high-water marks from fetch responses)."""
    from stream_rl.transport.client import Transport

    cfg = resolve(config, set_, {"kafka.bootstrap_servers": bootstrap, "topics.run": run})
    if not all_runs or dry_run:
        select_run(cfg, "topics", dry_run)
    require_broker(cfg)
    transport = Transport(cfg, "cli")
    reader = transport.reader()
    prefix = f"{cfg.topics.prefix}.{cfg.topics.run}."
    rows = []
    for topic in sorted(t for t in reader.topics() if all_runs or t.startswith(prefix)):
        tps = reader.partitions(topic)
        marks = reader.highwaters(tps)
        rows.append({"topic": topic, "partitions": len(tps), "records": sum(marks.values()),
                     "highwaters": [marks[tp] for tp in tps]})
    reader.close()
    for row in rows:
        typer.echo(json.dumps(row) if as_json else f"{row['topic']}\t{row['partitions']}\t{row['records']}")


@topics_app.command("delete")
def topics_delete(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None,
                  run: RunOpt = None, dry_run: DryRunOpt = False) -> None:
    """Delete a run's topics and consumer groups (its records and committed offsets) from the broker; the run must
    be named (--run NAME). Its run directory is left as it is (`stream-rl topics list --run NAME` shows what is
    there first)."""
    from stream_rl.cli.runs import delete_run

    cfg = resolve(config, set_, {"kafka.bootstrap_servers": bootstrap, "topics.run": run}, dry_run)
    if "run" not in cfg.topics.model_fields_set:
        fail("topics delete: name the run to delete with --run NAME (`stream-rl topics list --all` lists them)", 2)
    require_broker(cfg)
    topics = delete_run(cfg)
    typer.echo(f"run {cfg.topics.run}: deleted {len(topics)} topics and its consumer groups" if topics
               else f"run {cfg.topics.run}: no topics on the broker (its consumer groups were deleted)")


@app.command("replay")
def replay(topic: Annotated[str, typer.Argument(help="logical name (rollouts, scored, dlq, ...) or full name")],
           from_offset: Annotated[int, typer.Option(help="first offset per partition")] = 0,
           limit: Annotated[int | None, typer.Option(help="at most this many records per partition")] = None,
           partition: Annotated[int | None, typer.Option(help="only this partition")] = None,
           show_content: Annotated[bool, typer.Option("--show-content", "--show-text", help=(
               "print sample content as is: texts, answers, token ids, metadata values, prompt-bearing ids "
               "and raw bytes"))] = False,
           config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None,
           run: RunOpt = None, dry_run: DryRunOpt = False) -> None:
    """Print a topic's records of the newest run (or --run) as decoded JSON lines, sample content redacted unless
    --show-content (docs/status-and-traces.md). Never commits. After `stream-rl run` has ended (its local broker
    stopped), the local broker is started on its durable store for the replay and stopped after."""
    cfg = resolve(config, set_, {"kafka.bootstrap_servers": bootstrap, "topics.run": run})
    with local_broker_for(cfg, "replay", dry_run):
        _replay(select_run(cfg, "topics", dry_run), topic, from_offset, limit, partition, show_content)


def _replay(cfg, topic: str, from_offset: int, limit: int | None, partition: int | None, show_content: bool) -> None:
    from stream_rl.operator_tools.replay import Redactor, record_to_json, redaction_key
    from stream_rl.transport.client import Transport
    from stream_rl.transport.topics import resolve_topic

    redactor = None if show_content else Redactor(redaction_key(cfg.broker.state_dir))
    require_broker(cfg)
    transport = Transport(cfg, "cli")
    full = resolve_topic(transport.names, topic)
    reader = transport.reader()
    try:
        tps = reader.partitions(full)
    except KeyError as exc:
        fail(str(exc.args[0]))
    if partition is not None:
        if partition not in {p for _, p in tps}:
            fail(f"topic {full} has no partition {partition} (it has {len(tps)})")
        tps = [(name, p) for name, p in tps if p == partition]
    for tp in tps:
        for rec in reader.read_range(tp, from_offset, limit):
            typer.echo(json.dumps(record_to_json(rec, show_content, redactor)))
    reader.close()


@contextlib.contextmanager
def local_broker_for(cfg, command: str, dry_run: bool = False):
    """The local broker a command reads an ended run from. With ``kafka.bootstrap_servers`` unset and no local
    broker running (``stream-rl run`` stops the one it started): a durable one (``broker.storage``, the default) is
    started on its store in ``broker.state_dir`` for the command and stopped after it; a memory one lost its
    records with its stop, which is said in one line (exit 1). Otherwise (an address given, a broker up, a dry
    run) nothing is started."""
    from stream_rl import broker

    if dry_run or cfg.kafka.bootstrap_servers or broker.status(cfg.broker)[0]:
        yield
        return
    if cfg.broker.storage != "durable":
        fail(f"{command}: no local broker runs in {cfg.broker.state_dir}, and its storage is 'memory': the records "
             f"of a run that ended went with it (broker.storage = \"durable\", the default, keeps them)")
    typer.echo(f"{command}: starting the local broker on its durable store in {cfg.broker.state_dir} (stopped "
               f"when done)", err=True)
    try:
        broker.up(cfg.broker)
    except broker.BrokerError as exc:
        fail(f"{command}: the local broker in {cfg.broker.state_dir} is not running and did not start: {exc}")
    try:
        yield
    finally:
        broker.down(cfg.broker)


@app.command("config")
def show_config(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None,
                run: RunOpt = None, dry_run: DryRunOpt = False) -> None:
    """Print the resolved configuration (secrets masked); --dry-run changes nothing here."""
    resolve(config, set_, {"kafka.bootstrap_servers": bootstrap, "topics.run": run}, dry_run=True)


@app.callback()
def _global_options(debug: Annotated[bool, typer.Option(
        "--debug", envvar="STREAM_RL_DEBUG", help="show the traceback of every failure, not only the one line "
        "(also STREAM_RL_DEBUG=1)")] = False) -> None:
    """Asynchronous, streaming RL fine-tuning of LLMs over Kafka."""
    from stream_rl.cli.errors import set_debug

    set_debug(debug)


def main() -> None:
    """The ``stream-rl`` entry point: an expected failure ends in one line and its exit code (stream_rl.cli.errors),
    anything else in a traceback."""
    from stream_rl.cli.errors import run_app

    run_app(app)


if __name__ == "__main__":
    main()
