"""Shared CLI plumbing: config resolution from file, environment and flags, with one-line errors and exit 2, and
the broker probe a role runs before it starts (one line naming the address when no broker answers)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from stream_rl.cli.config import StreamRLConfig, config_warnings, load_config
from stream_rl.config.base import ConfigError
from stream_rl.config.loading import dump_config, parse_sets

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML or YAML config file "
                                                "(default: $STREAM_RL_CONFIG)")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="override a field: section.field=value "
                                                  "(repeatable; wins over file and environment)")]
BootstrapOpt = Annotated[str | None, typer.Option("--bootstrap", "-b", help="Kafka bootstrap servers "
                                                  "(kafka.bootstrap_servers)")]
RunOpt = Annotated[str | None, typer.Option("--run", help="run name used in topic names (topics.run)")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="print the resolved config and exit")]


_resolved: list[Any] = []  # the config this process's command resolved (named by stream_rl.cli.errors)


def resolved_config() -> Any:
    """The config the running command resolved, None before it got that far."""
    return _resolved[-1] if _resolved else None


def fail(message: str, code: int = 1) -> None:
    typer.echo(message, err=True)
    raise typer.Exit(code)


def resolve(config: Path | None, sets: list[str] | None, flags: dict[str, Any] | None = None,
            dry_run: bool = False, model: Any = None):
    """Resolve the config (defaults < file < env < --set < named flags); exit 2 naming the field if invalid."""
    overrides: dict[str, Any] = {}
    try:
        overrides.update(parse_sets(sets or []))
        overrides.update({k: v for k, v in (flags or {}).items() if v is not None})
        cfg = load_config(config, overrides=overrides, **({"model": model} if model else {}))
    except ConfigError as exc:
        fail(str(exc), 2)
    _resolved[:] = [cfg]
    if isinstance(cfg, StreamRLConfig):
        for line in config_warnings(cfg):
            typer.echo(f"warning: {line}", err=True)
    if dry_run:
        typer.echo(dump_config(cfg))
        raise typer.Exit(0)
    return cfg


def require_broker(cfg: StreamRLConfig) -> None:
    """Raise BrokerUnreachable (one line naming the address) when no broker answers within the connect timeout
    (``kafka.connect_timeout_s``, at most ``kafka.broker_timeout_s``). Run before the role configures logging, so
    kafka-python's retries print nothing."""
    from stream_rl.broker import resolve_bootstrap
    from stream_rl.cli.errors import no_broker_message
    from stream_rl.transport.admin import reaches_broker
    from stream_rl.transport.edge import BrokerUnreachable
    from stream_rl.transport.settings import connect_timeout_s

    bootstrap = resolve_bootstrap(cfg.kafka.bootstrap_servers, cfg.broker)
    if not reaches_broker(cfg.kafka, bootstrap, f"{cfg.kafka.client_id}-probe"):
        raise BrokerUnreachable(no_broker_message(bootstrap, connect_timeout_s(cfg.kafka)))
