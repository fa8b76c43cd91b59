"""Rewards routed by data source (stream_rl.rewards.routing, scorer.rewards) without a broker: the router, the
config's validation errors naming their field, the scorer's pure step with routes (an unrouted rollout rejected
with the key and value), and the trainer's per-source reward and accuracy against hand-computed values."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
from support.messages import rollout_for_scoring
from support.trainer import scored

from consumers.scorer.config import ScorerConfig
from consumers.scorer.scoring import Rejected, Scoring, load_scoring, score_rollouts
from consumers.trainer.rollout_metrics import rollout_metrics, source_metrics
from schemas import ScoredRollout
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError
from stream_rl.rewards.contract import RewardFnError, RewardOutput, RewardValueError
from stream_rl.rewards.routing import (
    RewardRouter,
    RewardRoutes,
    RewardTerm,
    UnroutedError,
    combine,
    route,
)

GSM, MATH = (RewardTerm("gsm8k", 2.0),), (RewardTerm("math_boxed", 1.0), RewardTerm("multiple_choice", 0.5))

USER_MODULE = '''
def format_bonus(prompt, response, answer, metadata):
    return 1.0 if "\\\\boxed" in response else 0.0

def per_token(prompt, response, answer, metadata):
    return {"reward": 0.5, "token_rewards": [0.25, 0.0, 0.25]}
'''


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A user's reward module ``h2_user_rewards`` importable as ``h2_user_rewards:<fn>``."""
    (tmp_path / "h2_user_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "h2_user_rewards"
    sys.modules.pop("h2_user_rewards", None)


# ---------------------------------------------------------------- the router


def test_route_picks_the_value_s_terms_then_the_default():
    routes = RewardRoutes(routes={"openai/gsm8k": GSM, "math": MATH}, default=(RewardTerm("multiple_choice"),))
    assert route(routes, {"data_source": "math", "other": "x"}) == MATH
    assert route(routes, {"data_source": "openai/gsm8k"}) == GSM
    assert route(routes, {"data_source": "poetry"}) == (RewardTerm("multiple_choice"),)
    assert route(routes, {}) == (RewardTerm("multiple_choice"),)
    by_task = RewardRoutes(by="task", routes={"math": MATH})
    assert route(by_task, {"task": "math", "data_source": "openai/gsm8k"}) == MATH


def test_no_route_and_no_default_names_the_key_and_value():
    routes = RewardRoutes(routes={"openai/gsm8k": GSM})
    with pytest.raises(UnroutedError) as err:
        route(routes, {"data_source": "poetry"})
    assert str(err.value) == ("no reward route for data_source='poetry' (scorer.rewards.by = 'data_source'; "
                              "routes: ['openai/gsm8k']; no default)")
    assert (err.value.key, err.value.value) == ("data_source", "poetry")
    with pytest.raises(UnroutedError, match="no reward route for no metadata 'data_source'"):
        route(routes, {"task": "x"})


@pytest.mark.parametrize("build, message", [
    (lambda: RewardTerm("gsm8k", 0.0), "weight must be finite and non-zero"),
    (lambda: RewardTerm("gsm8k", float("nan")), "weight must be finite and non-zero"),
    (lambda: RewardTerm("gsm9k"), "neither a built-in reward"),
    (lambda: RewardTerm("a:b:c"), "exactly one ':'"),
    (lambda: RewardRoutes(routes={"m": ()}), "route 'm': the list of rewards is empty"),
    (lambda: RewardRoutes(routes={"m": GSM + GSM}), "route 'm': ['gsm8k'] listed more than once"),
    (lambda: RewardRoutes(default=()), "default: the list of rewards is empty"),
    (lambda: RewardRoutes(), "at least one route or a default"),
    (lambda: RewardRoutes(by="", default=GSM), "metadata key to route rewards on is empty"),
])
def test_bad_routes_are_refused_when_built(build, message):
    with pytest.raises(ValueError) as err:
        build()
    assert message in str(err.value)


def test_combine_weights_every_component_and_token_rewards():
    terms = (RewardTerm("gsm8k", 2.0), RewardTerm("m:f", -0.5))
    plain = combine(terms, [RewardOutput(1.0), RewardOutput(0.5)], response_length=3)
    assert plain.reward == 1.75 and plain.components == {"gsm8k": 2.0, "m:f": -0.25}
    assert plain.token_rewards is None  # nobody returned token rewards: the scorer puts the reward on the last
    dense = combine(terms, [RewardOutput(1.0), RewardOutput(0.5, np.array([0.25, 0.0, 0.25], np.float32))], 3)
    # 2.0 * 1.0 on the last token + (-0.5) * [0.25, 0, 0.25]
    assert dense.token_rewards.tolist() == [-0.125, 0.0, 1.875] and dense.reward == 1.75


def test_router_loads_each_function_once_and_names_the_failing_one(user_rewards):
    routes = RewardRoutes(routes={"math": (RewardTerm("math_boxed"), RewardTerm(f"{user_rewards}:format_bonus", 0.1))},
                          default=(RewardTerm("math_boxed"),))
    router = RewardRouter.load(routes)
    assert sorted(router.fns) == ["h2_user_rewards:format_bonus", "math_boxed"]
    got = router.score(prompt="p", response=r"so \boxed{\dfrac12}", answer="0.5", metadata={"data_source": "math"},
                       response_length=3)
    assert got.reward == pytest.approx(1.1)
    assert got.components == {"math_boxed": 1.0, "h2_user_rewards:format_bonus": 0.1}
    with pytest.raises(RewardValueError, match="reward 'math_boxed': .* the rollout has none"):
        router.score(prompt="p", response="x", answer=None, metadata={}, response_length=1)
    with pytest.raises(RewardFnError, match="has no attribute 'nope'"):
        RewardRouter.load(RewardRoutes(default=(RewardTerm(f"{user_rewards}:nope"),)))


# ---------------------------------------------------------------- the config section

ROUTED_TOML = '''
[scorer.rewards]
by = "data_source"
default = [{fn = "gsm8k", weight = 1.0}]
[scorer.rewards.routes]
"openai/gsm8k" = [{fn = "gsm8k", weight = 1.0}]
"math" = [{fn = "math_boxed", weight = 1.0}, {fn = "mypkg.rewards:format_bonus", weight = 0.1}]
'''


def test_the_documented_config_loads_and_replaces_reward_fn(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(ROUTED_TOML)
    cfg = load_config(path, env={})
    assert cfg.scorer.reward_fn is None
    routes = cfg.scorer.rewards.to_routes()
    assert routes == RewardRoutes(by="data_source", default=(RewardTerm("gsm8k"),), routes={
        "openai/gsm8k": (RewardTerm("gsm8k"),),
        "math": (RewardTerm("math_boxed"), RewardTerm("mypkg.rewards:format_bonus", 0.1))})
    assert load_config(None, env={}).scorer.rewards is None  # the single reward_fn stays the default


@pytest.mark.parametrize("overrides, field, message", [
    ({"scorer.rewards.routes.math": [{"fn": "gsm8k", "weight": 0}]}, "scorer.rewards.routes.math.0.weight",
     "weight 0 adds nothing"),
    ({"scorer.rewards.routes.math": [{"fn": "gsm8k", "weight": "inf"}]}, "scorer.rewards.routes.math.0.weight",
     "finite"),
    ({"scorer.rewards.routes.math": [{"fn": "nope"}]}, "scorer.rewards.routes.math.0.fn",
     "neither a built-in reward"),
    ({"scorer.rewards.routes.math": [{"fn": "1bad:fn"}]}, "scorer.rewards.routes.math.0.fn", "module part '1bad'"),
    ({"scorer.rewards.routes.math": []}, "scorer.rewards.routes.math", "at least 1 item"),
    ({"scorer.rewards.routes.math": [{"fn": "gsm8k"}, {"fn": "gsm8k"}]}, "scorer.rewards",
     "route 'math': ['gsm8k'] listed more than once"),
    ({"scorer.rewards.routes.math": [{"fn": "gsm8k", "wieght": 2}]}, "scorer.rewards.routes.math.0.wieght",
     "unknown field"),
    ({"scorer.rewards.default": []}, "scorer.rewards.default", "at least 1 item"),
    ({"scorer.reward_fn": "mypkg:f"}, "scorer", "set scorer.rewards or scorer.reward_fn, not both"),
])
def test_bad_routed_config_names_the_field(tmp_path, overrides, field, message):
    path = tmp_path / "c.toml"
    path.write_text(ROUTED_TOML)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={}, overrides=overrides)
    text = str(err.value)
    assert text.startswith(f"invalid config: {field}: ") and message in text and "\n" not in text


# ---------------------------------------------------------------- the scorer's pure step


def test_scorer_step_routes_each_rollout_and_rejects_an_unrouted_one(user_rewards):
    routes = RewardRoutes(routes={
        "math": (RewardTerm("math_boxed"), RewardTerm(f"{user_rewards}:format_bonus", 0.1)),
        "openai/gsm8k": (RewardTerm("gsm8k", 2.0), RewardTerm(f"{user_rewards}:per_token", -1.0))})
    scoring = Scoring(scorer_id="scorer-0", router=RewardRouter.load(routes), token_level_rewards=True)
    rollouts = [
        rollout_for_scoring(0, 0, response_text=r"\boxed{\frac12}", answer="0.5", metadata={"data_source": "math"}),
        rollout_for_scoring(1, 0, response_text="#### 1,234", answer="1234", metadata={"data_source": "openai/gsm8k"}),
        rollout_for_scoring(2, 0, response_text="#### 7", answer="7", metadata={"data_source": "poetry"}),
        rollout_for_scoring(3, 0, response_text="#### 7", answer=None, metadata={"data_source": "openai/gsm8k"}),
    ]
    math_out, gsm_out, unrouted, failed = score_rollouts(rollouts, scoring)
    assert isinstance(math_out, ScoredRollout) and isinstance(gsm_out, ScoredRollout)
    assert math_out.reward == pytest.approx(1.1)
    assert math_out.reward_components == {"math_boxed": 1.0, "h2_user_rewards:format_bonus": pytest.approx(0.1)}
    assert math_out.token_rewards.tolist() == pytest.approx([0.0, 0.0, 1.1])  # no token rewards: all on the last
    assert gsm_out.reward == 1.5 and gsm_out.reward_components == {"gsm8k": 2.0, "h2_user_rewards:per_token": -0.5}
    assert gsm_out.token_rewards.tolist() == [-0.25, 0.0, 1.75]  # 2.0 on the last - [0.25, 0, 0.25]
    assert unrouted == Rejected(rollouts[2], "no reward route for data_source='poetry' (scorer.rewards.by = "
                                             "'data_source'; routes: ['math', 'openai/gsm8k']; no default)",
                                "UnroutedError")
    assert isinstance(failed, Rejected) and failed.error_type == "ValueError"
    assert "reward 'gsm8k'" in failed.reason and "the rollout has none" in failed.reason


def test_load_scoring_builds_the_router_from_the_config_and_a_reward_model_adds_to_it(user_rewards):
    cfg = ScorerConfig(rewards={"default": [{"fn": "gsm8k"}], "routes": {"mc": [{"fn": "multiple_choice"}]}})
    scoring = load_scoring(cfg, "scorer-0")
    assert scoring.reward_fn is None and scoring.router.routes == cfg.rewards.to_routes()
    out = score_rollouts([rollout_for_scoring(0, 0, response_text="The answer is (B)", answer="B",
                                              metadata={"data_source": "mc"}),
                          rollout_for_scoring(1, 0, response_text="#### 7", answer="8")], scoring)
    assert [(o.reward, o.reward_components) for o in out] == [(1.0, {"multiple_choice": 1.0}), (0.0, {"gsm8k": 0.0})]
    with pytest.raises(ValueError, match="not both"):
        Scoring(scorer_id="scorer-0", reward_fn=len, router=scoring.router)


def test_single_reward_fn_scoring_is_unchanged():
    cfg = ScorerConfig(reward_fn="consumers.scorer.builtin_rewards:exact_match", reward_fn_weight=0.5,
                       token_level_rewards=True)
    out = score_rollouts([rollout_for_scoring(0, 0)], load_scoring(cfg, "scorer-0"))[0]
    assert out.reward == 0.5 and out.reward_components == {"reward_fn": 0.5}
    assert out.token_rewards.tolist() == [0.0, 0.0, 0.5]


# ---------------------------------------------------------------- the trainer's per-source metrics


def _scored(i: int, reward: float, components: dict[str, float], source: str | None) -> ScoredRollout:
    base = scored(i, 0, reward=reward)
    metadata = {} if source is None else {"data_source": source}
    return dataclasses.replace(base, reward_components=components,
                               rollout=dataclasses.replace(base.rollout, metadata=metadata))


def test_per_source_reward_and_accuracy_hand_values():
    items = [
        _scored(0, 1.1, {"gsm8k": 1.0, "m:format": 0.1}, "openai/gsm8k"),  # correct
        _scored(1, 0.1, {"gsm8k": 0.0, "m:format": 0.1}, "openai/gsm8k"),  # wrong, formatted
        _scored(2, 2.0, {"gsm8k": 2.0}, "openai/gsm8k"),  # correct, weight 2
        _scored(3, -0.5, {"math_boxed": -0.5}, "math"),  # correct with a negative weight: still correct
        _scored(4, 0.0, {"math_boxed": 0.0}, "math"),  # wrong
        _scored(5, 1.0, {"math_boxed": 1.0, "multiple_choice": 0.0}, "mixed"),  # one verifier wrong: wrong
        _scored(6, 0.7, {"reward_model": 0.7}, "chat"),  # no verifier: reward only
        _scored(7, 9.0, {"gsm8k": 9.0}, None),  # no data_source: in no source
    ]
    m = source_metrics(items)
    assert m == {
        "reward/source/openai/gsm8k": pytest.approx((1.1 + 0.1 + 2.0) / 3), "accuracy/source/openai/gsm8k": 2 / 3,
        "reward/source/math": -0.25, "accuracy/source/math": 0.5,
        "reward/source/mixed": 1.0, "accuracy/source/mixed": 0.0,
        "reward/source/chat": 0.7,
    }
    whole = rollout_metrics(items, current_version=0, success_threshold=1.0)
    assert {k: v for k, v in whole.items() if "/source/" in k} == m
    assert whole["reward/mean"] == pytest.approx((1.1 + 0.1 + 2.0 - 0.5 + 0.0 + 1.0 + 0.7 + 9.0) / 8)

