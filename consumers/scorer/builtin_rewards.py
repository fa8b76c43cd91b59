"""Kept so that ``consumers.scorer.builtin_rewards:<name>`` references in existing configs still load: the rewards
live in :mod:`stream_rl.rewards.simple`, and every short name in :mod:`stream_rl.rewards.names`."""

from __future__ import annotations

from stream_rl.rewards.simple import REWARDS, contains_answer, exact_match, last_number_match, strip_response

__all__ = ["REWARDS", "contains_answer", "exact_match", "last_number_match", "strip_response"]
