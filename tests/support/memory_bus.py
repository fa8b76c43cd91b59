"""A run's config on the in-process bus (``memory://<run name>``, :mod:`stream_rl.transport.memory`), the one
place the tests that run roles without a broker build it (the unit tier's ``make_config`` and the integration
tests that use the bus for speed)."""

from __future__ import annotations

from pathlib import Path


def memory_config(run_name: str, run_dir: Path | str | None, **overrides):
    """The :class:`~stream_rl.config.StreamRLConfig` of run ``run_name`` on ``memory://<run_name>`` with its run
    directory ``run_dir``; ``overrides`` are dotted keys (``**{"topics.partitions": {...}}``) applied on top."""
    from stream_rl.cli.config import load_config

    base = {"kafka.bootstrap_servers": f"memory://{run_name}", "topics.run": run_name,
            "run_dir": None if run_dir is None else str(run_dir)}
    return load_config(None, env={}, overrides={**base, **overrides})
