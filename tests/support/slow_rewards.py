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


def overlap_counted(sleep_s: float):
    """A per-rollout reward that takes ``sleep_s`` and counts its calls in flight: ``(fn, state)``, ``state["peak"]``
    the most ever at once."""
    import time

    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    def reward(prompt, response, answer, metadata):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(sleep_s)
        with lock:
            state["now"] -= 1
        return 1.0

    return reward, state


class _Overlap:
    """Calls of :func:`slow_batch` in flight now, and the most ever at once."""

    lock = threading.Lock()
    now = 0
    peak = 0


OVERLAP = _Overlap


def _slow_batch(prompts, responses, answers, metadatas):
    """A batched reward service that takes 0.4 s per call: exact match of every rollout, counting overlap."""
    import time

    with _Overlap.lock:
        _Overlap.now += 1
        _Overlap.peak = max(_Overlap.peak, _Overlap.now)
    time.sleep(0.4)
    with _Overlap.lock:
        _Overlap.now -= 1
    return [exact_match(p, r, a, m) for p, r, a, m in zip(prompts, responses, answers, metadatas)]


_slow_batch.batched = True
slow_batch = _slow_batch
