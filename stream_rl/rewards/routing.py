"""Rewards routed by a prompt's metadata (``data_source`` by default): which functions score a rollout, with which
weights, and their weighted sum.

Consumes: a :class:`RewardRoutes` (the metadata key to route on, value -> reward terms, an optional default) and,
per rollout, its metadata (and texts, answer and response length to score it).
Produces: the terms of a rollout (:func:`route`), a :class:`RewardRouter` with every function loaded once, and per
rollout a :class:`RoutedReward`: the reward, one component per term and the optional token rewards.
Guarantees:
- A term's ``fn`` is a built-in reward's short name (:data:`stream_rl.rewards.names.BUILTIN_NAMES`) or a
  ``module:function`` reference (:mod:`stream_rl.rewards.contract`); routes are checked when built: a non-empty
  key, no empty list, finite non-zero weights, no function twice in one list, at least one route or a default.
- A rollout whose value (or missing key) has no route and no default raises :class:`UnroutedError`, whose message
  names the key and the value (the scorer dead-letters the rollout with it): no reward is guessed.
- A fall-through is visible: a value with no route that the default scores (e.g. verl's MATH
  ``DigitalLearningGmbH/MATH-lighteval`` under a ``"math"`` route, scored by a ``gsm8k`` default) is described by
  :func:`fall_through` (the prompt loader warns with it, per value), and :class:`RewardRouter` logs it once per
  value at WARNING, so a verifier changed by a misspelt source name shows in the scorer's log.
- Combination (one rule, the scorer's)::

      reward            = sum_i w_i * r_i
      reward_components = {fn_i: w_i * r_i}                      (so the components sum to the reward)
      token_rewards     = sum_i w_i * t_i   [R], t_i = fn_i's token rewards, or r_i on the last token
                          (None when no function of the route returned token rewards)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from stream_rl.rewards.contract import (
    RewardFn,
    RewardFnError,
    RewardOutput,
    RewardValueError,
    call_reward_fn,
)
from stream_rl.rewards import names

log = logging.getLogger(__name__)


class UnroutedError(LookupError):
    """A rollout's metadata value has no reward route and there is no default; ``str()`` is the reason."""

    def __init__(self, key: str, value: str | None, known: Sequence[str], where: str = "scorer.rewards") -> None:
        what = f"{key}={value!r}" if value is not None else f"no metadata {key!r}"
        super().__init__(f"no reward route for {what} ({where}.by = {key!r}; routes: {sorted(known)}; "
                         f"no default)")
        self.key, self.value = key, value


@dataclass(frozen=True)
class RewardTerm:
    """One reward function of a route: a built-in short name or ``module:function``, and its weight."""

    fn: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        check_fn_name(self.fn)
        if not math.isfinite(self.weight) or self.weight == 0:
            raise ValueError(f"reward {self.fn!r}: weight must be finite and non-zero, got {self.weight}")


def check_fn_name(fn: str) -> str:
    """``fn`` if it is a built-in short name or a well-formed ``module:function`` (RewardFnError otherwise)."""
    return names.check_name(fn)


def check_terms(terms: Sequence[RewardTerm], where: str) -> tuple[RewardTerm, ...]:
    """``terms`` as a tuple after checking it is non-empty and names no function twice (``where`` names it)."""
    if not terms:
        raise ValueError(f"{where}: the list of rewards is empty")
    names = [t.fn for t in terms]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{where}: {twice} listed more than once (one entry per function, weights add up)")
    return tuple(terms)


@dataclass(frozen=True)
class RewardRoutes:
    """``by``: the metadata key; ``routes``: its value -> terms; ``default``: terms for any other value; ``where``:
    the setting they came from, named in the reasons (``scorer.rewards``, ``eval.rewards``)."""

    by: str = "data_source"
    routes: Mapping[str, tuple[RewardTerm, ...]] = field(default_factory=dict)
    default: tuple[RewardTerm, ...] | None = None
    where: str = field(default="scorer.rewards", compare=False)

    def __post_init__(self) -> None:
        if not self.by:
            raise ValueError("the metadata key to route rewards on is empty")
        for value, terms in self.routes.items():
            check_terms(terms, f"route {value!r}")
        if self.default is not None:
            check_terms(self.default, "default")
        if not self.routes and self.default is None:
            raise ValueError("reward routes need at least one route or a default")

    def functions(self) -> list[str]:
        """Every function named by a route or the default, once, in first-seen order."""
        every = [t.fn for terms in (*self.routes.values(), self.default or ()) for t in terms]
        return list(dict.fromkeys(every))


def route(routes: RewardRoutes, metadata: Mapping[str, str]) -> tuple[RewardTerm, ...]:
    """The terms for a rollout with ``metadata``: its value's route, else the default, else UnroutedError."""
    value = metadata.get(routes.by)
    if value is not None and value in routes.routes:
        return routes.routes[value]
    if routes.default is not None:
        return routes.default
    raise UnroutedError(routes.by, value, list(routes.routes), routes.where)


def fall_through(routes: RewardRoutes, metadata: Mapping[str, str]) -> str | None:
    """None when ``metadata``'s value has a route, when there is no default (nothing falls through) or no route
    (the default is the only rule); else the line saying that the default scores it, naming the value, the
    default's functions and the routes there are."""
    value = metadata.get(routes.by)
    if routes.default is None or not routes.routes or (value is not None and value in routes.routes):
        return None
    what = f"{routes.by}={value!r}" if value is not None else f"a prompt without metadata {routes.by!r}"
    default = ", ".join(t.fn for t in routes.default)
    return (f"{what} has no reward route: scored by the default [{default}] ({routes.where}.routes: "
            f"{sorted(routes.routes)})")


def resolve_fn(fn: str) -> RewardFn:
    """The callable of a term: a built-in reward's (:mod:`stream_rl.rewards.names`) or the imported
    ``module:function``."""
    return names.resolve(fn)


@dataclass(frozen=True)
class RoutedReward:
    """A rollout's routed reward: the weighted sum, its components and the optional token rewards ``[R]``."""

    reward: float
    components: dict[str, float]
    token_rewards: np.ndarray | None = None


def combine(terms: Sequence[RewardTerm], outputs: Sequence[RewardOutput], response_length: int) -> RoutedReward:
    """Weighted sum of checked outputs (module docstring); ``outputs[i]`` is ``terms[i]``'s."""
    components = {t.fn: t.weight * o.reward for t, o in zip(terms, outputs, strict=True)}
    token_rewards = None
    if any(o.token_rewards is not None for o in outputs):
        dense = np.zeros(response_length, dtype=np.float64)  # [R]
        for t, o in zip(terms, outputs, strict=True):
            if o.token_rewards is not None:
                dense += t.weight * o.token_rewards.astype(np.float64)
            else:
                dense[-1] += t.weight * o.reward
        token_rewards = dense.astype(np.float32)
    return RoutedReward(float(sum(components.values())), components, token_rewards)


@dataclass(frozen=True)
class RewardRouter:
    """Routes with every function loaded once (:meth:`load`); :meth:`score` scores one rollout."""

    routes: RewardRoutes
    fns: Mapping[str, RewardFn]
    _fell_through: set[str | None] = field(default_factory=set, compare=False, repr=False)  # values logged

    @classmethod
    def load(cls, routes: RewardRoutes) -> RewardRouter:
        """Import every function the routes name (RewardFnError names a bad one)."""
        return cls(routes, {fn: resolve_fn(fn) for fn in routes.functions()})

    def score(self, *, prompt: str, response: str, answer: str | None, metadata: Mapping[str, str],
              response_length: int) -> RoutedReward:
        """The routed reward of one rollout; UnroutedError (no route) or RewardValueError (a function failed)."""
        terms = route(self.routes, metadata)
        self._log_fall_through(metadata)
        outputs = []
        for term in terms:
            try:
                outputs.append(call_reward_fn(self.fns[term.fn], prompt=prompt, response=response, answer=answer,
                                              metadata=metadata, response_length=response_length))
            except RewardValueError as exc:
                raise RewardValueError(f"reward {term.fn!r}: {exc}") from exc.__cause__
        return combine(terms, outputs, response_length)

    def _log_fall_through(self, metadata: Mapping[str, str]) -> None:
        """Log :func:`fall_through` once per metadata value (a bounded set: the data's sources)."""
        value = metadata.get(self.routes.by)
        if value in self._fell_through or (value is not None and value in self.routes.routes):
            return
        line = fall_through(self.routes, metadata)
        if line is not None and len(self._fell_through) < 1000:
            self._fell_through.add(value)
            log.warning("%s", line)
