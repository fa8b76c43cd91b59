"""Environment hubs: other projects' tasks, environments and verifiers used by name (optional, ``stream-rl[envs]``).

Modules: :mod:`~stream_rl.hubs.rgym` (reasoning-gym datasets as a prompt source, and their own ``score_answer``
as the ``reasoning_gym`` reward), :mod:`~stream_rl.hubs.vf` (verifiers tasksets as a prompt source, and the
task's own rewards as the ``verifiers`` reward). A named prompt source is written where a prompt file's path goes
(``reasoning-gym:NAME?...``, ``verifiers:ID?...``): :func:`source_kind` says which hub reads it. Each module
imports its hub package only when it is used, and a missing package is one :class:`HubMissing` error naming the
extra; the rest of the core never imports a hub.
"""

from __future__ import annotations

import importlib
from types import ModuleType

ENVS_EXTRA = "pip install 'stream-rl[envs]'"


class HubMissing(ImportError):
    """A hub's package is not installed; ``str()`` names it and the extra that installs it."""

    def __init__(self, package: str, what: str) -> None:
        super().__init__(f"{what} needs the {package} package: {ENVS_EXTRA} (or pip install {package})")


SOURCES = {"reasoning-gym": "stream_rl.hubs.rgym", "verifiers": "stream_rl.hubs.vf"}
"""A named prompt source's prefix (before the ``:``) -> the hub module that reads it (``parse_spec``,
``records``, ``SpecError``)."""


def source_kind(source: object) -> str | None:
    """The hub that reads ``source`` (a key of :data:`SOURCES`), or None for a file path."""
    prefix, colon, _ = str(source).partition(":")
    return prefix if colon and prefix in SOURCES else None


def source_module(kind: str) -> ModuleType:
    """The module of hub ``kind`` (it imports its hub package only when used)."""
    return importlib.import_module(SOURCES[kind])
