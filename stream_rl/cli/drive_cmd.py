"""CLI command ``stream-rl drive`` (registered in :mod:`stream_rl.cli.main`).

Consumes: the resolved config's ``driver`` section (``--gateway`` overrides ``driver.gateway_url``; without either,
the ``gateway`` section's host and port name the gateway, as under ``stream-rl run``).
Produces: the driver role (:func:`producers.driver.role.run_driver`): verifiers environments played through the
gateway until every group is played (``--stay``: then until SIGTERM / SIGINT, as ``run`` starts it).
Guarantees: ``--dry-run`` prints the resolved config and touches nothing; no ``[driver]`` section, an environment
verifiers cannot load, a gateway that does not answer, or too many failed episodes in a row end the command with
one line naming the cause (exit 2 for the config, 1 otherwise). The driver needs no broker (the gateway records);
with ``kafka.bootstrap_servers`` set (always under ``stream-rl run``) it sends heartbeats of role ``driver``
(:mod:`producers.driver.health`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from stream_rl.cli.common import ConfigOpt, DryRunOpt, SetOpt, fail, resolve
from stream_rl.cli.roles_cmd import InstanceOpt


def drive(config: ConfigOpt = None, set_: SetOpt = None, instance: InstanceOpt = None,
          gateway: Annotated[str | None, typer.Option(help="driver.gateway_url: the gateway's base URL "
                                                      "(http://HOST:PORT/v1)")] = None,
          stay: Annotated[bool, typer.Option(help="once every group is played, wait for SIGTERM instead of "
                                             "exiting (how stream-rl run starts it)")] = False,
          dry_run: DryRunOpt = False) -> None:
    """Play verifiers environments by their own agent loop through the gateway (docs/agents.md)."""
    from stream_rl.cli.roles_cmd import run_role, setup_logging, stop_on_signals

    cfg = resolve(config, set_, {"driver.gateway_url": gateway})
    if cfg.driver is None:
        fail("no [driver] section: set driver.environment = \"verifiers:TASKSET_ID?size=N\" (docs/agents.md)", 2)
    if cfg.driver.gateway_url is None:
        cfg.driver.gateway_url = gateway_url_of(cfg)
    if dry_run:
        from stream_rl.config.loading import dump_config

        typer.echo(dump_config(cfg))
        raise typer.Exit(0)
    setup_logging()
    from producers.driver.gateway_client import GatewayUnavailable
    from producers.driver.role import DriverError, run_driver
    from stream_rl.hubs import HubMissing
    from stream_rl.hubs.vf import SpecError

    health = None
    if cfg.kafka.bootstrap_servers:  # heartbeats for stream-rl status; the driver itself needs no broker
        from producers.driver.health import DriverHealth

        health = DriverHealth(cfg)
    try:
        run_role(lambda _cfg, *a, **k: run_driver(*a, **k), cfg, cfg.driver, stop_event=stop_on_signals(),
                 stay=stay, report=None if health is None else health.report)
    except (SpecError, HubMissing) as exc:
        fail(f"driver.environment: {exc}", 2)
    except (DriverError, GatewayUnavailable) as exc:
        fail(f"driver stopped: {exc}")
    finally:
        if health is not None:
            health.close()


def gateway_url_of(cfg) -> str | None:
    """The base URL of the config's own gateway (``gateway.host``/``gateway.port``); None without a section."""
    if cfg.gateway is None:
        return None
    host = "127.0.0.1" if cfg.gateway.host in ("0.0.0.0", "::") else cfg.gateway.host
    return f"http://{host}:{cfg.gateway.port}/v1"
