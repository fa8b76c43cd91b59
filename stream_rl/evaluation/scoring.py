"""Rewards and answer extraction for held-out evaluation (core helpers: the evaluator role and the CLI use them).

Consumes: ``eval.reward_fn`` (a built-in verifier's short name or ``package.module:function`` with the scorer's
contract ``fn(prompt, response, answer, metadata) -> float | {"reward": float, ...}``) or routes in the scorer's
one routing shape (``eval.rewards``, as ``scorer.rewards``: metadata key, value -> weighted functions, default:
:class:`stream_rl.rewards.settings.RewardsConfig`), and an extractor name.
Produces: a :data:`Reward` callable (one response -> a finite float) built on the scorer's own router
(:class:`stream_rl.rewards.routing.RewardRouter`; a single ``reward_fn`` is one default route), and an
:data:`Extract` callable (``text -> answer or None``) for maj@k.
Guarantees: a malformed or unimportable function fails at load with one line naming ``eval.reward_fn`` /
``eval.rewards``; a response the router cannot score (the function raised or returned no finite number, or
no route matched) raises :class:`EvalRewardError` with the router's reason (the evaluator counts it in
``reward_errors`` with reward 0, it does not die on one response). Extractors: ``VERIFIERS[name].extract``
(:mod:`stream_rl.rewards.verifiers`) or the built-in ``last_number``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from stream_rl.rewards.contract import RewardFnError, RewardValueError
from stream_rl.rewards.routing import RewardRouter, RewardRoutes, RewardTerm, UnroutedError, check_fn_name
from stream_rl.rewards.verifiers import VERIFIERS

Reward = Callable[[str, str, "str | None", Mapping[str, str], int], float]
"""``reward(prompt, response, answer, metadata, response_length) -> float``."""
Extract = Callable[[str], "str | None"]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class EvalRewardError(ValueError):
    """The evaluation's reward cannot be loaded, or gave no usable value for one response."""


def check_reward_fn(fn: str, field: str = "eval.reward_fn") -> str:
    """Syntax only (no import): a verifier name or ``module:function``; EvalRewardError naming ``field``."""
    try:
        return check_fn_name(fn)
    except (RewardFnError, ValueError) as exc:
        raise EvalRewardError(f"{field}: {exc}") from None


def load_reward(routes: RewardRoutes) -> Reward:
    """The reward of one response: its route's weighted functions (:class:`RewardRoutes`, the scorer's routing:
    ``routes[metadata[by]]``, else the default); a single ``eval.reward_fn`` is a table of one default route
    (:func:`single_route`)."""
    try:
        router = RewardRouter.load(routes)
    except (RewardFnError, ValueError) as exc:
        raise EvalRewardError(f"eval.reward_fn / eval.rewards: {exc}") from None

    def reward(prompt: str, response: str, answer: str | None, metadata: Mapping[str, str],
               response_length: int) -> float:
        try:
            return router.score(prompt=prompt, response=response, answer=answer, metadata=metadata,
                                response_length=max(1, response_length)).reward
        except (RewardValueError, UnroutedError) as exc:
            raise EvalRewardError(str(exc)) from exc

    return reward


def single_route(reward_fn: str) -> RewardRoutes:
    """The routing table of one reward function for every response (``eval.reward_fn``)."""
    return RewardRoutes(default=(RewardTerm(reward_fn),), where="eval.reward_fn")


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``"12"``, ``"-3.5"``), normalised (``"07"`` -> ``"7"``); None when none."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = found[-1]
    return str(int(value)) if "." not in value else str(float(value))


def load_extractor(name: str | None) -> Extract | None:
    """The extractor ``name`` names: a verifier's ``extract`` or the built-in ``last_number``; None for None.
    ValueError naming ``eval.extractor`` for an unknown name."""
    if name is None:
        return None
    if name in VERIFIERS:
        return VERIFIERS[name].extract
    if name == "last_number":
        return last_number
    raise ValueError(f"eval.extractor: unknown extractor {name!r}; known: {sorted(VERIFIERS) + ['last_number']}")
