"""CLI commands ``stream-rl status`` and ``stream-rl trace show`` (registered in :mod:`stream_rl.cli.main`).

Consumes: the resolved config (status: broker address, topic prefix, the run and its directory's endpoint files)
or a run directory (trace show); both default to the newest run (:mod:`stream_rl.cli.runs`).
Produces: status: a live terminal view (rich) refreshed every ``--interval`` seconds; when stdout is not a
terminal, plain-text snapshots instead (one per refresh, each led by a ``--- stream-rl status <time>`` line), or
with ``--once`` one snapshot (``--json``: one JSON document; without ``--once`` one JSON line per refresh); trace
show: text. With ``--dry-run`` both print the resolved config and exit 0.
Guarantees: status only reads (no group joined, nothing committed or sent) and exits 1 with one line when the
broker is unreachable, 2 for an unknown run; Ctrl-C ends it with exit 0. trace show exits 1 naming the missing
span file and the setting that writes it. Neither prints sample text: heartbeats, alerts and spans carry none.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from stream_rl.cli.common import BootstrapOpt, ConfigOpt, DryRunOpt, RunOpt, SetOpt, fail, resolve
from stream_rl.cli.runs import select_run

trace_app = typer.Typer(help="Spans a run wrote to RUN_DIR/spans.jsonl (tracing.exporter=jsonl).",
                        no_args_is_help=True)
_METRICS_SHOWN = 16


def status(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
           once: Annotated[bool, typer.Option("--once", help="print one snapshot and exit")] = False,
           as_json: Annotated[bool, typer.Option("--json", help="JSON instead of tables")] = False,
           interval: Annotated[float, typer.Option(min=0.1, help="seconds between refreshes; with --once, "
                                                   "the throughput sampling window")] = 2.0,
           tail: Annotated[int, typer.Option(min=1, help="records read from the end of each partition of the "
                                             "status and alerts topics")] = 500,
           dry_run: DryRunOpt = False) -> None:
    """Live view of a running pipeline (the newest run, or --run) from its topics: roles, weights version,
    throughput, lag, alerts, endpoints. Without a terminal: one plain-text snapshot per refresh."""
    from stream_rl.operator_tools.status_read import StatusError, StatusReader

    cfg = select_run(resolve(config, set_, {"kafka.bootstrap_servers": bootstrap, "topics.run": run}), "topics",
                     dry_run)
    try:
        reader = StatusReader(cfg, tail=tail)
    except StatusError as exc:
        fail(f"stream-rl status: {exc}")
    try:
        if once:
            snap = _snapshot(reader, sample_s=min(interval, 1.0))
            if as_json:
                typer.echo(json.dumps(snap, indent=2, sort_keys=True))
            else:
                _console().print(_render(snap))
            return
        _exit_soon_after_ctrl_c()
        if as_json:
            while True:
                typer.echo(json.dumps(_snapshot(reader), sort_keys=True))
                time.sleep(interval)
        (_live if sys.stdout.isatty() else _plain)(reader, interval)
    except KeyboardInterrupt:
        return
    finally:
        reader.close()


CTRL_C_GRACE_S = 5.0
"""After Ctrl-C the viewer closes its broker clients; if that has not ended it within this long, it exits anyway."""


def _exit_soon_after_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt as usual and also arms a timer that ends the process (exit 0, output
    flushed) after :data:`CTRL_C_GRACE_S`: the read-only viewer never commits, so nothing is lost, and a broker
    client that swallows the interrupt or blocks in its close cannot keep it running (seen under a loaded broker)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def hard_exit() -> None:
        sys.stdout.flush()
        os._exit(0)

    def handler(signum, frame) -> None:
        timer = threading.Timer(CTRL_C_GRACE_S, hard_exit)
        timer.daemon = True
        timer.start()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def _plain(reader, interval: float) -> None:
    """Not a terminal (a pipe, a file, a CI log): a live view would print nothing, so one plain-text snapshot per
    refresh, each led by a line with its time."""
    console = _console()
    while True:
        snap = _snapshot(reader)
        console.print(f"--- stream-rl status {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(snap['time']))}",
                      markup=False, highlight=False)
        console.print(_render(snap))
        sys.stdout.flush()
        time.sleep(interval)


def _snapshot(reader, sample_s: float = 0.0) -> dict[str, Any]:
    from stream_rl.operator_tools.status_read import StatusError

    from stream_rl.evaluation.ledger import FILE_NAME, read_rows
    from stream_rl.evaluation.report import last_evaluation

    try:
        snap = reader.snapshot(sample_s=sample_s)
        snap["evaluation"] = last_evaluation(read_rows(Path(reader.cfg.run_dir) / FILE_NAME))  # RUN_DIR/evals.jsonl
        return snap
    except (StatusError, TimeoutError) as exc:
        fail(f"stream-rl status: {exc}")
    raise AssertionError("unreachable")


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _live(reader, interval: float) -> None:
    from rich.live import Live

    with Live(_render(_snapshot(reader)), console=_console(), refresh_per_second=4, screen=False) as live:
        while True:
            time.sleep(interval)
            live.update(_render(_snapshot(reader)))


def _render(snap: dict[str, Any]):
    """The snapshot as rich tables (roles, topics and lag, trainer metrics, alerts)."""
    from rich.console import Group
    from rich.table import Table

    parts = [_head(snap), _roles_table(snap["roles"]), _topics_table(snap)]
    if snap.get("endpoints"):
        parts.append(_endpoints_table(snap["endpoints"]))
    if snap["trainer_metrics"]:
        metrics = Table(title="last trainer metrics")
        metrics.add_column("metric")
        metrics.add_column("value")
        for key, value in list(snap["trainer_metrics"].items())[:_METRICS_SHOWN]:
            metrics.add_row(key, f"{value:.4g}")
        parts.append(metrics)
    if snap.get("reward_calls"):
        calls = Table(title="reward calls (each scorer's last batch)")
        for col in ("scorer", "metric", "value"):
            calls.add_column(col)
        for instance, values in snap["reward_calls"].items():
            for key, value in list(values.items())[:_METRICS_SHOWN]:
                calls.add_row(instance, key.removeprefix("rewards/"), f"{value:.4g}")
        parts.append(calls)
    if snap.get("servers"):
        parts.append(_servers_table(snap["servers"]))
    if snap.get("environments"):
        parts.append(_environments_table(snap["environments"]))
    if snap.get("gateways"):
        parts.append(_gateways_table(snap["gateways"]))
    if snap.get("evaluation"):
        ev = snap["evaluation"]
        evals = Table(title=f"last evaluation: v{ev['version']} (step {ev['step']})")
        evals.add_column("metric")
        evals.add_column("value")
        for key, value in sorted(ev["metrics"].items())[:_METRICS_SHOWN]:
            evals.add_row(key, f"{value:.4g}")
        parts.append(evals)
    parts.append(_alerts_table(snap["alerts"]))
    return Group(*parts)


def _head(snap: dict[str, Any]):
    """The first line: the run, its weights version (step and age) and the data's epoch and distinct prompts."""
    from rich.text import Text

    weights = snap["weights"]
    data = snap.get("data") or {}
    progress = "".join(f"  {label} {data[key]}" for key, label in (("epoch", "epoch"),
                       ("distinct_prompts", "distinct prompts")) if data.get(key) is not None)
    return Text(f"run {snap['run']}  weights version "
                f"{weights['version'] if weights else 'none yet'}"
                + (f" (step {weights['step']}, {weights['age_s']:.0f} s ago)" if weights and weights['step']
                   is not None else "") + progress, style="bold")


def _roles_table(roles: list[dict[str, Any]]):
    """One row per role instance from its last heartbeat."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="roles")
    for col in ("role", "instance", "host/pid", "status", "state", "age s", "version", "stale", "step", "rates /s"):
        table.add_column(col)
    for r in roles:
        rates = " ".join(f"{k}={v:.1f}" for k, v in sorted(r["rates"].items()))
        table.add_row(r["role"], r["instance_id"], f"{r['host']}/{r['pid']}",
                      Text(r["status"], style="green" if r["status"] == "alive" else "bold red"), r["state"],
                      f"{r['age_s']:.1f}", str(r["policy_version"]),
                      "" if r["staleness"] is None else str(r["staleness"]), str(r["step"]), Text(rates))
    return table


def _topics_table(snap: dict[str, Any]):
    """One row per topic: partitions, records, rate, and the lag of the group that reads it."""
    from rich.table import Table

    table = Table(title="topics and lag")
    for col in ("topic", "partitions", "records", "records/s", "group", "lag (per partition)"):
        table.add_column(col)
    lag_by_topic = {v["topic"]: (g, v) for g, v in snap["lag"].items()}
    for name, t in snap["topics"].items():
        group, lag = lag_by_topic.get(name, ("", None))
        per = "" if lag is None else f"{lag['total']} ({', '.join(str(p['lag']) for p in lag['partitions'])})"
        rate = "" if t["records_per_s"] is None else f"{t['records_per_s']:.1f}"
        table.add_row(name, str(t["partitions"]), str(t["records"]), rate, group.rsplit(".", 1)[-1], per)
    return table


def _alerts_table(alerts: list[dict[str, Any]]):
    """One row per open alert."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"open alerts ({len(alerts)})")
    for col in ("name", "role", "instance", "action", "message"):
        table.add_column(col)
    for a in alerts:
        table.add_row(a["name"], a["role"], a["instance_id"], a["action"], Text(a["message"]))
    return table


def _endpoints_table(endpoints: list[dict[str, Any]]):
    from rich.table import Table
    from rich.text import Text

    style = {"running": "green", "stale": "bold red", "unknown": "yellow"}
    table = Table(title="endpoints (run_dir/endpoints)")
    for col in ("instance", "role", "url", "host/pid", "process"):
        table.add_column(col)
    for e in endpoints:
        table.add_row(e["instance_id"], e["role"], e["url"], f"{e['host']}/{e['pid']}",
                      Text(e["process"], style=style.get(e["process"], "")))
    return table


@trace_app.command("show")
def trace_show(run_dir: Annotated[Path | None, typer.Argument(help="the run directory or a spans.jsonl file "
                                                              "(default: the newest run's, or --run's)")] = None,
               rollout: Annotated[str | None, typer.Option(help="only this rollout's trace and the training "
                                                           "steps linked to it")] = None,
               limit: Annotated[int, typer.Option(min=0, help="newest traces printed after the summary")] = 3,
               config: ConfigOpt = None, set_: SetOpt = None, run: RunOpt = None, dry_run: DryRunOpt = False
               ) -> None:
    """Span trees with durations from RUN_DIR/spans.jsonl: a per-span summary and the newest traces, or one
    rollout's trace."""
    from stream_rl.operator_tools.trace_view import TraceViewError, load_spans, overview, rollout_view

    flags = {"topics.run": run, "run_dir": None if run_dir is None else str(run_dir)}
    cfg = select_run(resolve(config, set_, flags), "dir", dry_run)
    try:
        spans = load_spans(run_dir if run_dir is not None else Path(cfg.tracing.jsonl_path or cfg.run_dir))
        lines = rollout_view(spans, rollout) if rollout is not None else overview(spans, limit)
    except TraceViewError as exc:
        fail(f"stream-rl trace show: {exc}")
    typer.echo("\n".join(lines))


def _environments_table(environments: dict[str, dict[str, float]]):
    """One row per environment of each producer or driver: its episodes ok, failed and timed out, refilled (a
    producer's groups played again, a driver's failed episodes replaced) and left open by a dead driver and ended as
    failed (a driver's only: '-' for a producer)."""
    from rich.table import Table

    table = Table(title="environments (episodes since each producer or driver started)")
    for col in ("producer", "environment", "ok", "failed", "timed out", "refilled", "abandoned"):
        table.add_column(col)
    for instance, values in environments.items():
        for name in dict.fromkeys(key.split("/")[1] for key in values):
            cells = (values.get(f"env/{name}/{k}") for k in ("ok", "failed", "timed_out", "refilled", "abandoned"))
            table.add_row(instance, name, *("-" if v is None else f"{v:.0f}" for v in cells))
    return table


_GATEWAY_COLUMNS = (("open", "episodes_open"), ("ended", "episodes_ended"), ("published", "episodes_published"),
                    ("dead-lettered", "episodes_dead_lettered"), ("calls", "calls"), ("tokens", "tokens"),
                    ("dropped clients", "dropped_clients"), ("refused", "refused_connections"))


def _gateways_table(gateways: dict[str, dict[str, float]]):
    """One row per gateway: its episodes by state now, calls answered, tokens sampled, clients dropped and
    connections refused over ``gateway.max_connections`` since it started."""
    from rich.table import Table

    table = Table(title="gateways (episodes now; calls, tokens, dropped clients and refused connections since each "
                        "started)")
    for col in ("gateway", *(title for title, _ in _GATEWAY_COLUMNS)):
        table.add_column(col)
    for instance, values in gateways.items():
        table.add_row(instance, *(f"{values.get(f'gateway/{key}', float('nan')):.0f}" for _, key in _GATEWAY_COLUMNS))
    return table


def _servers_table(servers: dict[str, dict[str, float]]):
    """One row per inference server of each producer (``producer.engine = "server"``)."""
    from rich.table import Table

    table = Table(title="inference servers (each producer's fleet)")
    for col in ("producer", "server", "healthy", "version", "outstanding", "requests", "tokens", "failures"):
        table.add_column(col)
    for instance, values in servers.items():
        for i in range(int(values.get("servers/total", 0))):
            row = [values.get(f"servers/{i}/{key}", float("nan")) for key in
                   ("healthy", "version", "outstanding", "requests", "tokens", "failures")]
            table.add_row(instance, str(i), "yes" if row[0] else "NO", *(f"{v:.0f}" for v in row[1:]))
    return table

