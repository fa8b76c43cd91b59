"""One registry of the built-in rewards' short names: a name works in every command or in none.

Consumes: a reward name as a user writes it: a short name (``gsm8k``, ``exact_match``, ``code_tests``, ...) or a
``package.module:function`` reference.
Produces: :data:`BUILTIN_NAMES` (sorted), :data:`NEED_ANSWER`, :func:`check_name` (the name, or :class:`RewardFnError` naming every
short name) and :func:`resolve` (the callable). ``scorer.reward_fn``, ``scorer.rewards`` routes, ``stream-rl
rescore --reward``, ``stream-rl reward-server`` and the isolated reward workers all resolve through here.
Guarantees: short names never shadow a reference (a reference has a ``:``); resolving a short name imports only its
own module (``code_tests`` loads the sandbox, ``reasoning_gym`` and ``verifiers`` their hub's module, nothing else
does).
"""

from __future__ import annotations

from collections.abc import Callable

from stream_rl.rewards.contract import RewardFn, RewardFnError, load_reward_fn, parse_reference

DEFAULT_REWARD_FN = "stream_rl.demo.task:addition_reward"
"""The reward of the scorer and the evaluator when none is set: the built-in demo's verifier (exact answer of a
two-digit addition, reward in [0, 1]). Declared once here; both sections take it from here."""

_VERIFIERS = ("gsm8k", "math_boxed", "multiple_choice")
_SIMPLE = ("exact_match", "contains_answer", "last_number_match")
_SANDBOXED = ("code_tests",)
_HUBS = {"reasoning_gym": "stream_rl.hubs.rgym:reasoning_gym_reward", "verifiers": "stream_rl.hubs.vf:verifiers_reward"}
"""Rewards that are a hub's own verifier (the hub is imported when the name is resolved, ``stream-rl[envs]``)."""
BUILTIN_NAMES = tuple(sorted(_VERIFIERS + _SIMPLE + _SANDBOXED + tuple(_HUBS)))
NEED_ANSWER = frozenset(_VERIFIERS + _SIMPLE)
"""The built-ins that compare with the reference answer and fail a rollout without one (``code_tests`` also
reads its cases from ``metadata["tests"]``)."""


def _loader(name: str) -> Callable[[], RewardFn]:
    if name in _VERIFIERS:
        def verifier() -> RewardFn:
            from stream_rl.rewards.verifiers import VERIFIERS

            return VERIFIERS[name].reward
        return verifier
    if name in _HUBS:
        return lambda: load_reward_fn(_HUBS[name])
    module = "stream_rl.rewards.simple" if name in _SIMPLE else "stream_rl.rewards.sandbox"
    return lambda: load_reward_fn(f"{module}:{name}")


def check_name(name: str) -> str:
    """``name`` if it is a built-in short name or a well-formed ``module:function`` (RewardFnError otherwise)."""
    if name in BUILTIN_NAMES:
        return name
    if ":" not in name:
        raise RewardFnError(f"reward {name!r} is neither a built-in reward ({', '.join(BUILTIN_NAMES)}) nor a "
                            f"'module:function' reference")
    parse_reference(name)
    return name


def resolve(name: str) -> RewardFn:
    """The callable ``name`` stands for (a built-in's, or the imported ``module:function``)."""
    return _loader(name)() if name in BUILTIN_NAMES else load_reward_fn(check_name(name))
