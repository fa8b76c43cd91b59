"""Each setting is declared once (issue 44, section 2): a role's section holds the core's declaration (the same
default, bounds and description) instead of a copy, and the core object is built from the section without a
field-by-field copy."""

from __future__ import annotations

import pytest

from consumers.scorer.config import JudgeConfig, ScorerConfig
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError
from stream_rl.rewards.calls import CallPolicy
from stream_rl.rewards.judge import JudgeReward, JudgeSettings


def load(**overrides):
    return load_config(None, env={}, overrides={k.replace("__", "."): v for k, v in overrides.items()})


def same_declaration(a, b) -> bool:
    return (a.annotation, a.default, a.metadata, a.description) == (b.annotation, b.default, b.metadata,
                                                                    b.description)


def test_the_scorer_reward_call_fields_are_the_call_policy_fields():
    for name, field in CallPolicy.model_fields.items():
        assert same_declaration(ScorerConfig.model_fields[f"reward_{name}"], field), name
    scorer = load(scorer__reward_timeout_s="4", scorer__reward_max_retries="0").scorer
    assert scorer.call_policy == CallPolicy(timeout_s=4.0, max_retries=0)
    with pytest.raises(ConfigError, match="scorer.reward_concurrency: Input should be greater than or equal to 1"):
        load(scorer__reward_concurrency="0")
    with pytest.raises(ConfigError, match="scorer.reward_max_backoff_s must be >= scorer.reward_backoff_s"):
        load(scorer__reward_backoff_s="2", scorer__reward_max_backoff_s="1")
    with pytest.raises(ValueError, match="max_backoff_s must be >= backoff_s"):
        CallPolicy(backoff_s=2.0, max_backoff_s=1.0)


def test_the_judge_section_is_the_core_judge_settings_and_its_weight():
    assert issubclass(JudgeConfig, JudgeSettings)
    assert set(JudgeConfig.model_fields) - set(JudgeSettings.model_fields) == {"weight"}
    judge = JudgeConfig(base_url="http://127.0.0.1:1/v1", model="m", template="{response}", weight=2.0)
    judge.show_text = True  # a section: assignments are validated, not refused
    reward = JudgeReward(judge, timeout_s=7.0)
    assert reward.settings is judge and reward.timeout_s == 7.0
    with pytest.raises(ValueError, match=r"scorer.judge.template uses \['answer'\]"):
        JudgeSettings(base_url="http://127.0.0.1:1/v1", model="m", template="{answer}")
    with pytest.raises(ValueError, match="frozen"):
        JudgeSettings(base_url="http://127.0.0.1:1/v1", model="m", template="{response}").model = "other"
