"""Shared CLI plumbing: config resolution from file, environment and flags, with one-line errors and exit 2."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from stream_rl.config import ConfigError, StreamRLConfig, config_warnings, dump_config, load_config, parse_sets

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML or YAML config file "
                                                "(default: $STREAM_RL_CONFIG)")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="override a field: section.field=value "
                                                  "(repeatable; wins over file and environment)")]
BootstrapOpt = Annotated[str | None, typer.Option("--bootstrap", "-b", help="Kafka bootstrap servers "
                                                  "(kafka.bootstrap_servers)")]
RunOpt = Annotated[str | None, typer.Option("--run", help="run name used in topic names (topics.run)")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="print the resolved config and exit")]


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
    if isinstance(cfg, StreamRLConfig):
        for line in config_warnings(cfg):
            typer.echo(f"warning: {line}", err=True)
    if dry_run:
        typer.echo(dump_config(cfg))
        raise typer.Exit(0)
    return cfg
