"""Which run a command looks at: run discovery and the newest-run default of the commands that take a run.

Consumes: a resolved :class:`~stream_rl.config.StreamRLConfig` (whether ``topics.run`` and ``run_dir`` were set
explicitly: by a config file, ``STREAM_RL_*``, ``--set``, ``--run``, ``--run-dir`` or a ``RUN_DIR`` argument), the
run directories under :data:`RUNS_ROOT`, and, for the commands that read topics, the topic names on the broker.
Produces: the config with ``topics.run`` and ``run_dir`` set to the chosen run, and one line on stderr naming the
run when it was picked rather than given, e.g. ``run demo-20261201-101500 (newest of 3 in runs/; --run NAME to
choose)``.
Guarantees:
- A run directory is a directory directly under ``runs/`` holding ``config.yaml`` (the resolved config
  ``stream-rl run`` writes first, :func:`stream_rl.launch.orchestrator.write_run_config`); its run is that file's
  ``topics.run`` (else the directory name); the newest is the one whose ``config.yaml`` was written last.
- A run on the broker is one with a topic ``{topics.prefix}.{run}.{logical}`` for a logical topic of
  :data:`~stream_rl.transport.topics.LOGICAL_TOPICS`.
- What is given wins: an explicit ``run_dir`` is used as is (its ``config.yaml`` names the run unless
  ``topics.run`` is given too); an explicit ``topics.run`` must be a run directory (``where="dir"``: gc, report,
  trace show) or a run directory or a run on the broker (``where="topics"``: status, replay, topics list),
  otherwise :class:`RunError` (exit 2) lists the runs that exist. Without either, the newest run directory.
- ``--dry-run`` never contacts the broker: an explicit run that is not a run directory is taken as given, and
  without any run directory the configured run is kept (with a note on stderr); both exit 0.
- A run name used twice (below :func:`records_on_broker`): ``stream-rl run`` refuses a run whose topics already hold
  records unless ``--resume`` (:func:`reuse_refusal`, one line: the records, the run dir that wrote them, the three
  ways on); :func:`delete_run` (``stream-rl topics delete``) removes a run's topics and consumer groups.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import typer
import yaml

from stream_rl.cli.common import fail
from stream_rl.cli.config import StreamRLConfig
from stream_rl.config.loading import dump_config
from stream_rl.transport.topics import CONSUMER_GROUPS, LOGICAL_TOPICS, TopicNames

RUNS_ROOT = Path(StreamRLConfig.model_fields["run_dir"].default).parent
"""Where ``stream-rl run`` puts run directories (``runs/<run>/``, relative to the working directory)."""
RUN_CONFIG = "config.yaml"
_SHOWN = 10


class RunError(ValueError):
    """The run asked for does not exist, or there is no run to default to (exit 2)."""


@dataclass(frozen=True)
class LocalRun:
    """A run directory: the run's name, its directory and when its config was written (Unix seconds)."""

    name: str
    run_dir: Path
    started: float


def run_name_of(run_dir: Path) -> str:
    """The run a run directory belongs to: ``topics.run`` of its ``config.yaml``, else the directory name."""
    try:
        data = yaml.safe_load((run_dir / RUN_CONFIG).read_text()) or {}
        name = data.get("topics", {}).get("run")
    except (OSError, yaml.YAMLError, AttributeError):
        name = None
    return name if isinstance(name, str) and name else run_dir.name


def local_runs(root: Path = RUNS_ROOT) -> list[LocalRun]:
    """The run directories under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [LocalRun(run_name_of(d), d, (d / RUN_CONFIG).stat().st_mtime)
             for d in root.iterdir() if d.is_dir() and (d / RUN_CONFIG).is_file()]
    return sorted(found, key=lambda r: (r.started, r.name), reverse=True)


def runs_in_topics(topics: Iterable[str], prefix: str) -> set[str]:
    """Run names of the topics ``{prefix}.{run}.{logical}`` among ``topics``."""
    head = f"{prefix}."
    runs = set()
    for topic in topics:
        for logical in LOGICAL_TOPICS:
            tail = f".{logical}"
            if topic.startswith(head) and topic.endswith(tail) and len(topic) > len(head) + len(tail):
                runs.add(topic[len(head):-len(tail)])
    return runs


def _listing(local: list[LocalRun], on_broker: set[str] | None, root: Path) -> str:
    names = [r.name for r in local]
    parts = [f"runs in {root}/: {', '.join(names[:_SHOWN]) + (' ...' if len(names) > _SHOWN else '')}"
             if names else f"no run directories in {root}/"]
    if on_broker is not None:
        extra = sorted(on_broker - set(names))
        more = f" ... (+{len(extra) - _SHOWN} more: `stream-rl topics list --all`)" if len(extra) > _SHOWN else ""
        parts.append(f"runs on the broker: {', '.join(extra[:_SHOWN])}{more}" if extra
                     else "no other runs on the broker")
    return "; ".join(parts)


def choose_run(cfg: StreamRLConfig, where: str, local: list[LocalRun], on_broker: Callable[[], set[str]] | None,
               root: Path = RUNS_ROOT) -> str | None:
    """Point ``cfg`` at the run to use (module docstring); returns the note to print, or None when the run was
    given. ``on_broker`` lists the broker's runs (called only when needed); None: do not ask (dry run)."""
    explicit_run, explicit_dir = "run" in cfg.topics.model_fields_set, "run_dir" in cfg.model_fields_set
    if explicit_dir:
        if not explicit_run:
            try:
                cfg.topics.run = run_name_of(Path(cfg.run_dir))
            except ValueError:  # a directory name that is no run name (e.g. a spans.jsonl path): keep the config's
                pass
        return None
    if explicit_run:
        match = next((r for r in local if r.name == cfg.topics.run), None)
        if match is not None:
            cfg.run_dir = match.run_dir
            return None
        if where == "topics" and on_broker is None:
            return None
        broker = on_broker() if where == "topics" else None
        if broker is not None and cfg.topics.run in broker:
            return None
        raise RunError(f"unknown run {cfg.topics.run!r}: {_listing(local, broker, root)}")
    if not local:
        if on_broker is None:
            return f"run {cfg.topics.run} (as configured: no run directories in {root}/)"
        broker = on_broker() if where == "topics" else None
        raise RunError(f"no run to show: {_listing(local, broker, root)}; start one with `stream-rl run`, or "
                       "choose one with --run NAME")
    newest = local[0]
    cfg.topics.run, cfg.run_dir = newest.name, newest.run_dir
    return f"run {newest.name} (newest of {len(local)} in {root}/; --run NAME to choose)"


def broker_runs(cfg: StreamRLConfig) -> set[str]:
    """The runs with topics on the configured broker; exit 1 with one line when it cannot be reached."""
    from stream_rl.broker import BrokerError, answers_metadata, resolve_bootstrap
    from stream_rl.transport.client import Transport
    from stream_rl.transport.tracing import Tracing

    try:
        bootstrap = resolve_bootstrap(cfg.kafka.bootstrap_servers, cfg.broker)
    except BrokerError as exc:
        fail(str(exc), 1)
    if not answers_metadata(bootstrap):
        fail(f"broker {bootstrap} is unreachable (no answer to a metadata request): start it with "
              "`stream-rl broker up`, or pass --bootstrap HOST:PORT", 1)
    reader = Transport(cfg, "cli", tracing=Tracing("stream-rl-cli")).reader()
    try:
        return runs_in_topics(reader.topics(), cfg.topics.prefix)
    finally:
        reader.close()


def select_run(cfg: StreamRLConfig, where: str, dry_run: bool = False, root: Path = RUNS_ROOT) -> StreamRLConfig:
    """The CLI side of :func:`choose_run`: the note on stderr, exit 2 for an unknown run, and with ``dry_run`` the
    resolved config (with the chosen run) on stdout and exit 0."""
    try:
        note = choose_run(cfg, where, local_runs(root), None if dry_run else (lambda: broker_runs(cfg)), root)
    except RunError as exc:
        fail(str(exc), 2)
    if note:
        typer.echo(note, err=True)
    if dry_run:
        typer.echo(dump_config(cfg))
        raise typer.Exit(0)
    return cfg


# -- a run name used twice (issue 35.1): what the broker holds of a run, who wrote it, and removing it -------------

WRITER_FILE = "runs"
"""``{broker.state_dir}/runs/<run>.json``: the run directory of the `stream-rl run` that created a run on the local
broker (the broker's state directory is that broker's identity; a remote broker's runs are found under runs/)."""
_WEIGHTS_CHUNKS = re.compile(r"weights\.v\d+(\.delta)?")


def run_topic(names: TopicNames, topic: str) -> bool:
    """Whether ``topic`` is one of the run's: a logical topic or a weights chunk topic ``weights.v{N}[.delta]``."""
    logical = names.logical(topic)
    return logical is not None and (logical in LOGICAL_TOPICS or _WEIGHTS_CHUNKS.fullmatch(logical) is not None)


def records_on_broker(cfg: StreamRLConfig) -> dict[str, int]:
    """``{topic: records written}`` (the sum of its partitions' high-water marks) of every topic of the run that
    exists on the configured broker; empty when the run has none."""
    from stream_rl.transport.client import Transport
    from stream_rl.transport.tracing import Tracing

    transport = Transport(cfg, "cli", tracing=Tracing("stream-rl-cli"))
    with transport.reader() as reader:
        topics = sorted(t for t in reader.topics() if run_topic(transport.names, t))
        partitions = [p for topic in topics for p in reader.partitions(topic)]
        marks = reader.highwaters(partitions) if partitions else {}
    counts = dict.fromkeys(topics, 0)
    for (topic, _), mark in marks.items():
        counts[topic] += mark
    return counts


def record_writer(cfg: StreamRLConfig) -> None:
    """Remember, next to the local broker's state, which run directory created ``topics.run``."""
    path = Path(cfg.broker.state_dir) / WRITER_FILE / f"{cfg.topics.run}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": cfg.topics.run, "run_dir": str(Path(cfg.run_dir).resolve())}))


def writer_of(cfg: StreamRLConfig, local_broker: bool, root: Path = RUNS_ROOT) -> Path | None:
    """The run directory that wrote ``topics.run``: the local broker's record of it, else a run directory under
    ``root`` whose config names the run; None when neither says."""
    if local_broker:
        try:
            data = json.loads((Path(cfg.broker.state_dir) / WRITER_FILE / f"{cfg.topics.run}.json").read_text())
            return Path(data["run_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    match = next((r for r in local_runs(root) if r.name == cfg.topics.run), None)
    return match.run_dir if match is not None else None


def reuse_refusal(run: str, bootstrap: str, counts: dict[str, int], names: TopicNames, writer: Path | None) -> str:
    """The one line that refuses to start run ``run`` again over the records it already has (pure)::

        run myrun already has 6843 records on the broker at 127.0.0.1:9092 (rollouts 3200, scored 3200, ...),
        written by run dir /home/u/A: continue it with `stream-rl run --resume --run myrun`, choose another name
        with --run NAME, or delete its topics with `stream-rl topics delete --run myrun`
    """
    busiest = sorted(((n, names.logical(t)) for t, n in counts.items() if n), reverse=True)
    shown = ", ".join(f"{logical} {n}" for n, logical in busiest[:4]) + (", ..." if len(busiest) > 4 else "")
    by = f"run dir {writer}" if writer is not None else "a run dir this machine does not know"
    return (f"run {run} already has {sum(counts.values())} records on the broker at {bootstrap} ({shown}), written "
            f"by {by}: continue it with `stream-rl run --resume --run {run}`, choose another name with --run NAME, "
            f"or delete its topics with `stream-rl topics delete --run {run}`")


def delete_run(cfg: StreamRLConfig) -> list[str]:
    """Delete every topic of ``topics.run`` and its consumer groups (their committed offsets) on the configured
    broker, and the local broker's record of its writer; returns the topics deleted."""
    from stream_rl.transport.client import Transport
    from stream_rl.transport.tracing import Tracing

    transport = Transport(cfg, "cli", tracing=Tracing("stream-rl-cli"))
    with transport.admin() as admin:
        topics = sorted(t for t in admin.list_topics() if run_topic(transport.names, t))
        admin.delete_topics(topics, missing_ok=True)
        admin.delete_groups([transport.names.group(name) for name in CONSUMER_GROUPS])
    (Path(cfg.broker.state_dir) / WRITER_FILE / f"{cfg.topics.run}.json").unlink(missing_ok=True)
    return topics
