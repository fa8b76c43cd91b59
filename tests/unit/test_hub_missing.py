"""Without the envs extra, a hub named anywhere is one error naming the extra (the core never imports a hub)."""

from __future__ import annotations

import sys

import pytest

from producers.environment import EnvironmentLoadError, load_environment
from stream_rl.hubs import rgym, vf
from stream_rl.prompts import PromptFileError, check_prompt_file
from stream_rl.rewards.names import resolve


@pytest.fixture
def no_hubs(monkeypatch):
    for name in ("reasoning_gym", "reasoning_gym.factory", "verifiers", "verifiers.v1", "openenv", "openenv.core",
                 "openenv.core.env_server", "openenv.core.env_server.interfaces"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    rgym._dataset.cache_clear()
    vf._tasks.cache_clear()
    yield
    rgym._dataset.cache_clear()
    vf._tasks.cache_clear()


@pytest.mark.parametrize(("spec", "package"), [("reasoning-gym:basic_arithmetic?size=2", "reasoning-gym"),
                                               ("verifiers:vf_reverse?size=2", "verifiers")])
def test_a_named_source_without_its_hub_names_the_extra(no_hubs, spec, package):
    with pytest.raises(PromptFileError, match=rf"needs the {package} package: pip install 'stream-rl\[envs\]'"):
        check_prompt_file(spec)


def test_a_hub_reward_without_its_hub_fails_the_rollout_naming_the_extra(no_hubs):
    metadata = {"rg_dataset": "basic_arithmetic", "rg_size": "2", "rg_seed": "0", "rg_index": "0",
                "rg_config": "{}", "rg_question": "0" * 16}
    with pytest.raises(ImportError, match=r"stream-rl\[envs\]"):
        resolve("reasoning_gym")("p", "r", None, metadata)


def test_an_openenv_environment_without_openenv_core_is_refused_at_start_up(no_hubs):
    with pytest.raises(EnvironmentLoadError, match=r"needs openenv-core: pip install 'stream-rl\[envs\]'"):
        load_environment("openenv:some.module:Env")
