"""The routing example of docs/rewards.md keys the data sources verl writes, and a fall-through to the default is
visible (issue 40: the example keyed MATH as ``"math"`` with a ``gsm8k`` default; verl writes
``DigitalLearningGmbH/MATH-lighteval``, so a wrong ``\\boxed{\\frac{1}{4}}`` against ``\\frac{3}{4}`` scored 1.0)."""

from __future__ import annotations

import logging
import re
import tomllib
from pathlib import Path

from consumers.scorer.config import RewardsConfig
from stream_rl.rewards.routing import RewardRouter, RewardRoutes, RewardTerm, fall_through, route
from stream_rl.rewards.verifiers import VERIFIERS

DOC = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"
MATH = "DigitalLearningGmbH/MATH-lighteval"  # verl's examples/data_preprocess/math_dataset.py
WRONG, RIGHT, ANSWER = "so \\boxed{\\frac{1}{4}}", "so \\boxed{\\frac34}", "\\frac{3}{4}"


def documented_routes() -> RewardRoutes:
    """The first TOML block of the doc's "Routed rewards" section, read as the config reads it."""
    section = DOC.read_text().split("## Routed rewards", 1)[1]
    block = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    return RewardsConfig(**tomllib.loads(block)["scorer"]["rewards"]).to_routes()


def builtin_score(routes: RewardRoutes, source: str, response: str, answer: str) -> float:
    terms = [t for t in route(routes, {"data_source": source}) if t.fn in VERIFIERS]
    return sum(t.weight * VERIFIERS[t.fn].score(response, answer) for t in terms)


def test_the_documented_routes_score_verl_math_rows_with_the_math_verifier():
    routes = documented_routes()
    assert {"openai/gsm8k", MATH} <= set(routes.routes)
    assert [t.fn for t in route(routes, {"data_source": MATH})][0] == "math_boxed"
    assert builtin_score(routes, MATH, WRONG, ANSWER) == 0.0
    assert builtin_score(routes, MATH, RIGHT, ANSWER) == 1.0
    assert builtin_score(routes, "openai/gsm8k", "so #### 72", "72") == 1.0


def test_the_old_example_shows_what_a_silent_fall_through_did():
    old = RewardRoutes(routes={"math": (RewardTerm("math_boxed"),)}, default=(RewardTerm("gsm8k"),))
    assert builtin_score(old, MATH, WRONG, ANSWER) == 1.0  # gsm8k compares the last numbers: 4 == 4
    assert fall_through(old, {"data_source": MATH}) == (
        f"data_source={MATH!r} has no reward route: scored by the default [gsm8k] (scorer.rewards.routes: ['math'])")
    assert fall_through(old, {"data_source": "math"}) is None
    assert fall_through(RewardRoutes(default=(RewardTerm("gsm8k"),)), {"data_source": MATH}) is None  # no routes


def test_the_router_logs_a_fall_through_once_per_value(caplog):
    router = RewardRouter.load(RewardRoutes(routes={"math": (RewardTerm("math_boxed"),)},
                                            default=(RewardTerm("gsm8k"),)))
    caplog.set_level(logging.WARNING, logger="stream_rl.rewards.routing")
    for source in (MATH, MATH, "math", "openai/gsm8k"):
        router.score(prompt="p", response="#### 4", answer="4", metadata={"data_source": source},
                     response_length=3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [fall_through(router.routes, {"data_source": MATH}),
                     fall_through(router.routes, {"data_source": "openai/gsm8k"})]
