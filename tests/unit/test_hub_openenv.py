"""OpenEnv environments (openenv-core) as producer environments by name (``openenv:module:Class``), run
in-process against the real library: the policy's turns become the environment's actions, its observations the
replies, its rubric's rewards the episode's ``episode_reward``; hostile variants fail or end their own group only."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("openenv.core", reason="the envs extra is not installed: pip install -e '.[envs]'")

from support.multiturn import ScriptedChatEngine, episode_prompt  # noqa: E402
from support.openenv_guess import RELEASE  # noqa: E402

from producers.engines.base import Sampling  # noqa: E402
from producers.environment import EnvironmentLoadError, load_environment  # noqa: E402
from producers.multiturn import run_episodes  # noqa: E402
from stream_rl.demo.chat_model import build_chat_tokenizer  # noqa: E402
from stream_rl.rewards.given import REWARD_KEY, episode_reward  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    yield ScriptedChatEngine(build_chat_tokenizer(), ["5<|im_end|>", "x<|im_end|>", "7<|im_end|>"])
    RELEASE.set()


def _play(engine, name: str, deadline_s: float = 2.0):
    factory = load_environment(f"openenv:support.openenv_guess:{name}", deadline_s, refills=0)
    prompt = episode_prompt(text="Guess:")
    ids = list(engine.tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
    out = run_episodes(engine, [prompt], [ids], 2, sampling=Sampling(1.0), max_new_tokens=60, seed=0,
                       make_env=factory, max_turns=4)
    return out[0], factory.health


def test_an_openenv_environment_plays_episodes_and_its_rubric_is_the_reward(engine):
    group, health = _play(engine, "GuessDigit")
    assert health.ok == 2
    for episode in group:
        assert episode.texts[:2] == ["5", "higher or lower?"]  # the observation's text field is the reply
        assert episode.turns[1] == {"env": "GuessDigit", "role": "env"}
        # three guesses, none right (the secret is the seed's digit, not 5, x or 7) or the last one right
        assert episode.env_reward in (0.1 + 0.0 + 0.1, 0.1 + 0.0 + 1.0)
        assert episode_reward("", "", None, episode.env_metadata) == episode.env_reward
        assert set(episode.env_metadata) == {REWARD_KEY}


def test_a_crashing_hung_or_flooding_openenv_environment_fails_or_ends_its_group_only(engine):
    group, health = _play(engine, "Crashing")
    assert group == "environment failed: RuntimeError: the game server died" and health.failed == 2
    started = time.monotonic()
    group, health = _play(engine, "Hung", deadline_s=0.3)
    assert time.monotonic() - started < 5
    assert group.startswith("environment timed out: environment Hung step timed out")
    assert health.timed_out == 2
    group, health = _play(engine, "Flooding")  # 5 MB reply: cannot fit the budget, not tokenised
    assert all(e.finish_reason == "length" and e.env_reward == 0.5 for e in group) and health.ok == 2


@pytest.mark.parametrize(("reference", "words"), [
    ("openenv:support.openenv_guess:NotAnEnv", "is not an OpenEnv environment class"),
    ("openenv:support.openenv_guess:Nope", "has no attribute 'Nope'"),
])
def test_a_reference_that_is_no_openenv_environment_is_refused_at_start_up(reference, words):
    with pytest.raises(EnvironmentLoadError, match=words):
        load_environment(reference)
