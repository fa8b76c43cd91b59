"""Test reward functions for reward-call deadlines: one that hangs when a rollout's metadata asks for it."""

from __future__ import annotations

import threading

from consumers.scorer.builtin_rewards import exact_match

RELEASE = threading.Event()
"""Set by a test at its end: every hanging call returns (the scorer has long abandoned it)."""


def hang_when_asked(prompt, response, answer, metadata):
    """Exact match, except that a rollout with ``metadata["hang"]`` blocks until RELEASE (at most 60 s)."""
    if metadata.get("hang"):
        RELEASE.wait(60)
    return exact_match(prompt, response, answer, metadata)
