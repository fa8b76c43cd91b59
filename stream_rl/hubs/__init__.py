"""Environment hubs: other projects' tasks, environments and verifiers used by name (optional, ``stream-rl[envs]``).

Modules: :mod:`~stream_rl.hubs.rgym` (reasoning-gym datasets as a prompt source, and their own ``score_answer``
as the ``reasoning_gym`` reward). Each module imports its hub package only when it is used, and a missing package
is one :class:`HubMissing` error naming the extra; the rest of the core never imports a hub.
"""

from __future__ import annotations

ENVS_EXTRA = "pip install 'stream-rl[envs]'"


class HubMissing(ImportError):
    """A hub's package is not installed; ``str()`` names it and the extra that installs it."""

    def __init__(self, package: str, what: str) -> None:
        super().__init__(f"{what} needs the {package} package: {ENVS_EXTRA} (or pip install {package})")
