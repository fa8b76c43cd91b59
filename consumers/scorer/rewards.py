"""The scorer's name for the reward-function contract, which lives in the core (:mod:`stream_rl.rewards.contract`)
so that other roles (the evaluator) call reward functions the same way.

Consumes / Produces / Guarantees: those of :mod:`stream_rl.rewards.contract`; this module only re-exports its
public names (``RewardFn``, ``RewardFnError``, ``RewardValueError``, ``RewardOutput``, ``parse_reference``,
``load_reward_fn``, ``call_reward_fn``, ``check_reward_value``, ``WHAT``) for the code and tests that import them
from here.
"""

from __future__ import annotations

from stream_rl.rewards.contract import (
    WHAT,
    RewardFn,
    RewardFnError,
    RewardOutput,
    RewardValueError,
    call_reward_fn,
    check_reward_value,
    load_reward_fn,
    parse_reference,
)

__all__ = ["WHAT", "RewardFn", "RewardFnError", "RewardOutput", "RewardValueError", "call_reward_fn",
           "check_reward_value", "load_reward_fn", "parse_reference"]
