"""One registry of built-in reward names (stream_rl.rewards.names): every short name resolves the same callable in
scorer.reward_fn, scorer.rewards routes, stream-rl rescore --reward and stream-rl reward-server (issue 44: code_tests
worked in the reward server and was refused in scorer.rewards)."""

from __future__ import annotations

import pytest

from consumers.scorer.config import ScorerConfig
from consumers.scorer.rescore import RescoreError, reward_reference
from stream_rl.cli.reward_server_cmd import served_scorer
from stream_rl.rewards.names import BUILTIN_NAMES, resolve
from stream_rl.rewards.routing import RewardRouter, RewardRoutes, RewardTerm


def test_every_command_takes_every_short_name():
    assert set(BUILTIN_NAMES) == {"code_tests", "contains_answer", "exact_match", "gsm8k", "last_number_match",
                                  "math_boxed", "multiple_choice", "reasoning_gym", "verifiers"}
    for name in BUILTIN_NAMES:
        fn = resolve(name)
        assert callable(fn)
        assert ScorerConfig(reward_fn=name).reward_fn == name
        router = RewardRouter.load(RewardRoutes(by="data_source", routes={"x": (RewardTerm(name),)}))
        assert router.fns[name] == fn
        assert reward_reference(name) == name
        assert callable(served_scorer(name, batch_size=4, device="cpu", dtype="float32"))


def test_a_name_that_is_none_of_them_is_refused_the_same_way_everywhere():
    with pytest.raises(ValueError, match="neither a built-in reward"):
        ScorerConfig(reward_fn="codetests")
    with pytest.raises(ValueError, match="neither a built-in reward"):
        RewardTerm("codetests")
    with pytest.raises(RescoreError, match="neither a built-in reward"):
        reward_reference("codetests")
    with pytest.raises(ValueError, match="not a built-in reward"):
        served_scorer("codetests", batch_size=4, device="cpu", dtype="float32")


def test_the_old_module_path_still_loads():
    from stream_rl.rewards.contract import load_reward_fn
    from stream_rl.rewards.simple import exact_match

    assert load_reward_fn("consumers.scorer.builtin_rewards:exact_match") is exact_match
