"""``producer.env_isolation = "process"``: each environment instance in a child process of its own
(producers/env_process.py). An environment that exits, segfaults, holds the GIL past its deadline, floods, raises or
closes its pipes fails its own group with the reason (the producer's thread would have died or frozen), the
producer's process goes on, and no child outlives its play. A good environment plays as in-process."""

from __future__ import annotations

import os
import time

import pytest
from support.multiturn import ScriptedChatEngine, episode_prompt

from producers.engines.base import Sampling
from producers.environment import load_environment
from producers.multiturn import run_episodes
from stream_rl.demo.chat_model import build_chat_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


@pytest.fixture
def engine(tokenizer):
    return ScriptedChatEngine(tokenizer, ["5<|im_end|>", "7<|im_end|>", "9<|im_end|>"])


def _play(engine, name: str, pids, monkeypatch, deadline_s: float = 20.0, isolation: str = "process"):
    if pids is None:
        monkeypatch.delenv("SRL_ENV_PIDS", raising=False)
    else:
        pids.mkdir(exist_ok=True)
        monkeypatch.setenv("SRL_ENV_PIDS", str(pids))
    factory = load_environment(f"support.hostile_envs:{name}", deadline_s, refills=0, isolation=isolation)
    prompt = episode_prompt(text="Guess:")
    ids = list(engine.tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
    out = run_episodes(engine, [prompt], [ids], 2, sampling=Sampling(1.0), max_new_tokens=60, seed=0,
                       make_env=factory, max_turns=4)
    return out[0], factory.health


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _children_gone(pids) -> list[int]:
    found = [int(p.name) for p in pids.iterdir()]
    deadline = time.monotonic() + 5.0
    while any(_alive(pid) for pid in found) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_a_good_environment_plays_in_a_process_of_its_own_as_in_process(engine, tokenizer, tmp_path, monkeypatch):
    group, health = _play(engine, "Guess", tmp_path / "pids", monkeypatch)
    assert health.ok == 2
    own = {e.turns[1]["pid"] for e in group}
    assert len(own) == 2 and str(os.getpid()) not in own  # one child per episode, not this process
    for episode in group:
        assert episode.texts == ["5", "higher or lower?", "7"] and episode.env_reward == 1.0
    fresh = ScriptedChatEngine(tokenizer, ["5<|im_end|>", "7<|im_end|>", "9<|im_end|>"])
    same, _ = _play(fresh, "Guess", None, monkeypatch, isolation="thread")
    assert [e.texts for e in same] == [e.texts for e in group]  # the same episodes in-process
    children = _children_gone(tmp_path / "pids")
    assert len(children) == 2 and not any(_alive(pid) for pid in children)


@pytest.mark.parametrize(("name", "reason"), [
    ("Exits", "environment failed: EnvironmentDied: environment Exits step: its process died (exit code 3)"),
    ("Segfaults", "environment failed: EnvironmentDied: environment Segfaults step: its process died (killed by "
                  "SIGSEGV)"),
    ("Floods", "environment failed: EnvironmentDied: environment Floods step: an answer of 209"),
    ("Raises", "environment failed: RuntimeError: ValueError: the game server died"),
    ("ClosesStdout", "environment failed: EnvironmentDied: environment ClosesStdout step: its process"),
])
def test_an_environment_that_kills_or_floods_its_process_fails_its_group_only(engine, tmp_path, monkeypatch, name,
                                                                             reason):
    group, health = _play(engine, name, tmp_path / "pids", monkeypatch)
    assert isinstance(group, str) and group.startswith(reason), group
    assert health.failed == 2
    children = _children_gone(tmp_path / "pids")
    assert children and not any(_alive(pid) for pid in children)


def test_an_environment_holding_the_gil_past_its_deadline_is_killed(engine, tmp_path, monkeypatch):
    started = time.monotonic()
    group, health = _play(engine, "HoldsTheGil", tmp_path / "pids", monkeypatch, deadline_s=1.0)
    assert time.monotonic() - started < 15.0
    assert group.startswith("environment timed out: environment HoldsTheGil step timed out after 1 s "
                            "(producer.env_timeout_s); its process was killed"), group
    assert health.timed_out == 2
    children = _children_gone(tmp_path / "pids")
    assert children and not any(_alive(pid) for pid in children)


def test_a_bad_isolation_is_refused_naming_the_setting():
    from producers.environment import EnvironmentLoadError

    with pytest.raises(EnvironmentLoadError, match="producer.env_isolation must be 'thread' or 'process'"):
        load_environment("support.hostile_envs:Guess", 1.0, isolation="fork")
