"""Each setting is declared once (issue 44, section 2): a role's section holds the core's declaration (the same
default, bounds and description) instead of a copy, and the core object is built from the section without a
field-by-field copy."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from pydantic import Field

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


OUTSIDE = {"gt": lambda bound: bound, "ge": lambda bound: bound - 1, "lt": lambda bound: bound,
           "le": lambda bound: bound + 1}


def violating(declared) -> list[float]:
    """One value breaking each bound of a loss setting's declaration (its metadata)."""
    bad = [OUTSIDE[key](bound) for key, bound in declared.items() if key in OUTSIDE]
    return bad + ([math.inf] if declared.get("allow_inf_nan") is False else [])


def test_the_loss_section_fields_are_the_loss_spec_declarations():
    from consumers.trainer.config import LossConfig
    from stream_rl.algorithms.spec import LOSS_FIELDS

    assert set(LossConfig.model_fields) - set(LOSS_FIELDS) == {"off_policy_correction"}  # the trainer's own
    defaults_apart = set()
    for name, declared in LOSS_FIELDS.items():
        field = LossConfig.model_fields[name]
        assert field.description is declared.metadata["description"], name  # the declaration's own text
        assert field.metadata == Field(**declared.metadata).metadata, name  # its bounds, and no others
        assert declared.metadata.keys() <= {"description", "gt", "ge", "lt", "le", "allow_inf_nan"}, name
        if field.default != declared.default:
            defaults_apart.add(name)
    assert defaults_apart == {"is_cap"}  # the one default declared apart, on purpose (5.0: the trainer corrects)
    assert (LossConfig.model_fields["is_cap"].default, LOSS_FIELDS["is_cap"].default) == (5.0, None)


def test_a_value_out_of_its_declared_bounds_is_refused_by_the_section_and_the_spec_naming_it():
    from stream_rl.algorithms import LossSpec
    from stream_rl.algorithms.spec import LOSS_FIELDS

    tried = 0
    for name, declared in LOSS_FIELDS.items():
        for value in violating(declared.metadata):
            with pytest.raises(ConfigError, match=rf"trainer\.loss\.{name}"):
                load(**{f"trainer__loss__{name}": str(value)})
            with pytest.raises(ValueError, match=rf"^{name} must be"):
                LossSpec(**{name: value})
            tried += 1
    assert tried == 8  # clip_low 2, clip_high 2, dual_clip 1, is_cap 2, max_len 1
    message = r"dual_clip=3\.0 does not apply to kind='cispo' \(it uses clip_low, clip_high\)"
    with pytest.raises(ConfigError, match=message):
        load(trainer__loss__kind="cispo", trainer__loss__dual_clip="3")
    with pytest.raises(ValueError, match=message):
        LossSpec(kind="cispo", dual_clip=3.0)
    with pytest.raises(ConfigError, match="trainer.loss.clip"):  # an unknown key is still refused
        load(trainer__loss__clip="0.1")


def test_the_section_and_a_spec_resolve_the_same_kind_defaults():
    from stream_rl.algorithms import LossSpec

    for kind in ("ppo", "gspo", "cispo"):
        loss = load(trainer__loss__kind=kind).trainer.loss
        spec = LossSpec(kind=kind)
        assert (loss.clip_low, loss.clip_high, loss.agg) == (spec.clip_low, spec.clip_high, spec.agg), kind
        assert LossSpec.from_config(loss) == LossSpec(kind=kind, is_cap=5.0, max_len=loss.max_len)


def test_the_loss_declarations_load_and_check_without_pydantic():
    # bench/gpu.py runs the loss where pydantic is not installed: the one declaration must not need it
    code = ("import sys; sys.modules['pydantic'] = sys.modules['pydantic_core'] = None; "
            "from stream_rl.algorithms.spec import LOSS_FIELDS, LossSpec; "
            "assert LOSS_FIELDS['clip_low'].metadata['le'] == 1.0 and LossSpec(kind='gspo').clip_low == 3e-4\n"
            "try: LossSpec(clip_low=1.5)\nexcept ValueError as e: print(e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "clip_low must be <= 1.0, got 1.5"
