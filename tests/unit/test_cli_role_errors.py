"""A role command (produce/score/train) whose broker is lost mid-run ends in one line naming it, exit 1."""

from __future__ import annotations

import pytest


def test_a_role_that_loses_its_broker_ends_in_one_line(capsys):
    """`run_role` (produce/score/train): a broker lost mid-run is one line naming it, exit 1 (it used to end in a
    NameError: `logging` was not imported where the failure is logged)."""
    import typer

    from stream_rl.cli.config import load_config
    from stream_rl.cli.roles_cmd import run_role
    from stream_rl.transport.edge import BrokerUnreachable

    def lose_it(cfg):
        raise BrokerUnreachable("broker 127.0.0.1:9 unreachable: no answer for 61s while polling")

    with pytest.raises(typer.Exit) as info:
        run_role(lose_it, load_config(None, env={}, overrides={"kafka.bootstrap_servers": "127.0.0.1:9"}))
    assert info.value.exit_code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "BrokerUnreachable (broker 127.0.0.1:9): broker 127.0.0.1:9 unreachable: no answer for 61s while polling")
