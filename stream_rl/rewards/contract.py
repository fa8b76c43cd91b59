"""The reward-function contract (core: the scorer and the evaluator share it): loading ``module:function``
references, calling them and checking their values.

Consumes: a reference string such as ``stream_rl.demo.task:addition_reward`` (the part after the colon may be a
dotted attribute path, ``pkg.mod:Class.method``), and rollouts' texts.
Produces: the callable (:func:`load_reward_fn`) and, per rollout, a checked :class:`RewardOutput`
(:func:`call_reward_fn`).

The reward-function contract::

    fn(prompt: str, response: str, answer: str | None, metadata: dict[str, str]) -> float | dict

    float (int, bool, numpy scalar) -> the sequence reward
    dict                             -> {"reward": float, "token_rewards": [R floats] (optional)}

Guarantees:
- Loading fails early with :class:`RewardFnError` naming exactly what is wrong: the reference is malformed, the
  module does not exist, the module exists but raised while importing (with that error), the attribute is
  missing, it is not callable, or it cannot be called with the four positional arguments above.
- Calling never lets a bad value through: a non-finite reward, a number beyond a float (``10**400``), a wrong
  type, an unknown dict key (a typo such as ``"rewards"`` would otherwise be silently dropped) or token rewards of
  the wrong length or with non-finite values raise :class:`RewardValueError` whose message is the reason written
  to the dead-letter topic.
- :func:`check_reward_value` is total: whatever the value (a plug-in's object whose ``__float__`` or ``__iter__``
  raises included), it returns a checked :class:`RewardOutput` or raises :class:`RewardValueError`, nothing else
  (tests/unit/test_reward_values_fuzz.py fuzzes it).
  An exception raised by the function itself is wrapped the same way (the reason names its type and message):
  one bad record must not stop the scorer, and its reason is kept with the record.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stream_rl.runtime import references

RewardFn = Callable[[str, str, "str | None", dict], Any]
WHAT = "reward function reference"
_DICT_KEYS = frozenset({"reward", "token_rewards"})


class RewardFnError(ValueError):
    """The reward-function reference cannot be turned into a usable callable (a configuration error)."""


class RewardValueError(ValueError):
    """A reward function returned (or raised) something unusable for one record; ``str()`` is the reason."""


@dataclass(frozen=True)
class RewardOutput:
    """A checked reward: a finite float and, optionally, finite float32 token rewards ``[R]``."""

    reward: float
    token_rewards: np.ndarray | None = None


def parse_reference(reference: str) -> tuple[str, str]:
    """``"pkg.mod:fn"`` -> ``("pkg.mod", "fn")``; raises RewardFnError on a malformed reference."""
    return references.parse_reference(reference, what=WHAT, error=RewardFnError, attr_label="function")


def load_reward_fn(reference: str) -> RewardFn:
    """Import and return the function named by ``reference``, after checking it can take the 4 arguments."""
    obj = references.resolve_reference(reference, what=WHAT, error=RewardFnError, attr_label="function")
    attr_path = reference.split(":", 1)[1].strip()
    if not callable(obj):
        raise RewardFnError(f"reward function reference {reference!r}: {attr_path!r} is a "
                            f"{type(obj).__name__}, not callable")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins have no introspectable signature: trust them
        return obj
    try:
        signature.bind("prompt", "response", None, {})
    except TypeError as exc:
        raise RewardFnError(f"reward function reference {reference!r}: {attr_path}{signature} cannot be called as "
                            f"fn(prompt, response, answer, metadata): {exc}") from None
    return obj


def call_reward_fn(fn: RewardFn, *, prompt: str, response: str, answer: str | None,
                   metadata: Mapping[str, str], response_length: int) -> RewardOutput:
    """Call ``fn`` on one rollout and check its value; raises RewardValueError with the reason."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        value = fn(prompt, response, answer, dict(metadata))
    except Exception as exc:  # a per-record failure of user code: reported, the scorer goes on
        raise RewardValueError(f"reward function {name} raised {type(exc).__name__}: {error_text(exc, 2000)}") from exc
    return check_reward_value(value, response_length, name)


def check_reward_value(value: Any, response_length: int, name: str = "reward function") -> RewardOutput:
    """Turn a reward function's return value into a RewardOutput, or raise RewardValueError saying why."""
    try:
        return _checked(value, response_length, name)
    except RewardValueError:
        raise
    except Exception as exc:  # the value is a plug-in's object: its own methods may raise anything
        raise RewardValueError(f"{name} returned a {type(value).__name__} that cannot be read as a reward: "
                               f"{type(exc).__name__}: {error_text(exc)}") from None


def error_text(exc: BaseException, limit: int = 200) -> str:
    """At most ``limit`` characters of ``str(exc)``, even when that ``__str__`` is a plug-in's and raises."""
    try:
        text = str(exc)
    except Exception:
        return "<unprintable>"
    return text if len(text) <= limit else text[:limit] + "..."


def _checked(value: Any, response_length: int, name: str) -> RewardOutput:
    if isinstance(value, Mapping):
        unknown = sorted(set(map(str, value)) - _DICT_KEYS)
        if unknown:
            raise RewardValueError(f"{name} returned a dict with unknown keys {unknown}; allowed: "
                                   f"{sorted(_DICT_KEYS)}")
        if "reward" not in value:
            raise RewardValueError(f"{name} returned a dict without 'reward'")
        reward = finite_float(value["reward"], name)
        tokens = value.get("token_rewards")
        return RewardOutput(reward, None if tokens is None else _token_rewards(tokens, response_length, name))
    return RewardOutput(finite_float(value, name))


def finite_float(value: Any, name: str) -> float:
    """``value`` as a finite float; RewardValueError saying why not (wrong type, beyond a float, NaN or inf)."""
    if not isinstance(value, numbers.Real | np.bool_):  # bool, int, float and numpy scalars; not str or tensors
        raise RewardValueError(f"{name} returned {type(value).__name__}, expected a float or a dict with 'reward'")
    try:
        reward = float(value)
    except OverflowError:  # an int or Fraction beyond the float range (a JSON integer of 400 digits)
        raise RewardValueError(f"{name} returned a number too large for a float ({type(value).__name__})") from None
    if not math.isfinite(reward):
        raise RewardValueError(f"{name} returned a non-finite reward {reward}")
    return reward


def _token_rewards(tokens: Any, response_length: int, name: str) -> np.ndarray:
    try:
        array = np.asarray(tokens, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RewardValueError(f"{name} returned token_rewards that are not numbers: {error_text(exc)}") from None
    if array.shape != (response_length,):
        raise RewardValueError(f"{name} returned token_rewards of shape {list(array.shape)}, expected "
                               f"[{response_length}] (one per response token)")
    with np.errstate(over="ignore"):
        array = array.astype(np.float32)  # [R]; a value beyond float32 becomes inf here, and is refused below
    if not np.isfinite(array).all():
        raise RewardValueError(f"{name} returned non-finite token_rewards at positions "
                               f"{np.flatnonzero(~np.isfinite(array))[:5].tolist()}")
    return array
