"""Reward functions that misbehave the way user code does, for the worker-process isolation tests
(``scorer.reward_isolation = "process"``). Imported by the workers by reference, so plain module-level functions."""

from __future__ import annotations

import os
import re

from consumers.scorer.builtin_rewards import exact_match

_NESTED = re.compile(r"(a+)+$")


def backtracking(prompt, response, answer, metadata):
    """Exact match, after a nested-quantifier regex that backtracks exponentially on ``"a" * n + "b"``, the shape
    of a degenerate repetitive response (it holds the GIL while it runs)."""
    _NESTED.match(response)
    return exact_match(prompt, response, answer, metadata)


def chatty_huge_or_dying(prompt, response, answer, metadata):
    """Prints to stdout every call; ``metadata["do"]``: "huge" returns 10**400, "die" ends the process."""
    print("a user function printing to stdout", flush=True)
    if metadata.get("do") == "huge":
        return 10 ** 400
    if metadata.get("do") == "die":
        os._exit(3)
    return exact_match(prompt, response, answer, metadata)
