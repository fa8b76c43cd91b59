"""CLI command ``stream-rl gateway`` (registered in :mod:`stream_rl.cli.main`).

Consumes: the resolved config: the ``gateway`` section (its defaults when the config has none), the ``producer``
section (the policy engine, its model taken from the built demo when left at its default, sampling, token budget)
and the shared sections; ``--host`` / ``--port`` override ``gateway.host`` / ``gateway.port``.
Produces: the gateway role (:func:`producers.gateway.role.run_gateway`) serving until SIGTERM / SIGINT.
Guarantees: ``--dry-run`` prints the resolved config and touches nothing; exit codes as for the other roles
(:mod:`stream_rl.cli.roles_cmd`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from stream_rl.cli.common import BootstrapOpt, ConfigOpt, DryRunOpt, RunOpt, SetOpt
from stream_rl.cli.roles_cmd import InstanceOpt


def gateway(config: ConfigOpt = None, set_: SetOpt = None, bootstrap: BootstrapOpt = None, run: RunOpt = None,
            instance: InstanceOpt = None,
            host: Annotated[str | None, typer.Option(help="gateway.host: the address to listen on")] = None,
            port: Annotated[int | None, typer.Option(help="gateway.port: the port (0: a free one)")] = None,
            dry_run: DryRunOpt = False) -> None:
    """Serve the current policy to black-box agents over the OpenAI API and record their episodes (docs/agents.md)."""
    from stream_rl.cli.roles_cmd import _role_flags, role_config, run_role, setup_logging, stop_on_signals

    flags = {**_role_flags(bootstrap, run), "gateway.host": host, "gateway.port": port}
    if instance is not None:
        flags["producer.producer_id"] = f"gateway-{instance}"
    cfg = role_config(config, [*(set_ or []), *([] if _has_section(config, set_) else ["gateway.port=8000"])],
                      flags, dry_run, "produce")
    setup_logging()
    from producers.gateway.role import run_gateway

    run_role(run_gateway, cfg, cfg.gateway, cfg.producer, stop_event=stop_on_signals())


def _has_section(config, set_) -> bool:
    """Whether the config already sets a ``gateway`` section (else the command adds one with its defaults)."""
    from stream_rl.cli.common import resolve

    return resolve(config, set_, {}).gateway is not None
