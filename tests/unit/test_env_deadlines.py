"""Environments are adversaries (issue 42.2): a reset or step that raises, hangs past producer.env_timeout_s or
answers with a huge text fails or ends its own group only; a failed group is played again from the prompt
(producer.env_refills) and never trained partially; every outcome is counted per environment."""

from __future__ import annotations

import threading
import time

import pytest
from support.multiturn import ScriptedChatEngine, episode_prompt

from producers.engines.base import Sampling
from producers.environment import EnvironmentFactory, EnvironmentHealth, EnvironmentTimeout, call_with_deadline
from producers.multiturn import run_episodes
from stream_rl.demo.chat_model import build_chat_tokenizer

RELEASE = threading.Event()  # lets the hung environments' abandoned threads end with the test


@pytest.fixture(scope="module")
def engine():
    yield ScriptedChatEngine(build_chat_tokenizer(), ["12<|im_end|>", "46<|im_end|>"])
    RELEASE.set()


class Flaky:
    """Raises, hangs or floods on the step of the first ``bad`` instances made; answers "again" otherwise."""

    made = 0

    def __init__(self, how: str, bad: int):
        type(self).made += 1
        self.how, self.bad = how, type(self).made <= bad

    def reset(self, prompt):
        if self.bad and self.how == "reset":
            raise ValueError("no such level")

    def step(self, text):
        if self.bad and self.how == "hang":
            RELEASE.wait(60)
        if self.bad and self.how == "raise":
            raise RuntimeError("the simulator crashed")
        if self.bad and self.how == "huge":
            return "x" * 10_000_000
        return None if text == "46" else "again"


def _play(engine, how: str, bad: int, refills: int, deadline_s: float | None = 0.5, n: int = 2,
          replayed: list | None = None):
    Flaky.made = 0
    factory = EnvironmentFactory(lambda: Flaky(how, bad), "Flaky", deadline_s, refills)
    prompts = [episode_prompt(), episode_prompt(text="1+1=", answer="2")]
    ids = [list(engine.tokenizer(p.text, add_special_tokens=False)["input_ids"]) for p in prompts]
    out = run_episodes(engine, prompts, ids, n, sampling=Sampling(1.0), max_new_tokens=40, seed=1,
                       make_env=factory, max_turns=3)
    if replayed is not None:
        replayed += factory.drain_replayed()
        assert factory.replayed == []  # drained
    return out, factory.health


@pytest.mark.parametrize(("how", "reason"), [("raise", "environment failed: RuntimeError: the simulator crashed"),
                                             ("reset", "environment failed: ValueError: no such level")])
def test_a_group_whose_environment_raises_is_played_again_and_counted(engine, how, reason):
    replayed: list = []
    out, health = _play(engine, how, bad=1, refills=1, replayed=replayed)
    assert all(isinstance(group, list) and len(group) == 2 for group in out)  # refilled: whole groups, no part
    assert health == EnvironmentHealth(ok=4, failed=2, timed_out=0, refilled=1)
    # the failed play is kept for the dead-letter topic (the producer sends it), naming the prompt and the refill
    assert [(pid, epoch) for pid, epoch, _ in replayed] == [(episode_prompt().prompt_id, 0)]
    assert replayed[0][2] == f"{reason}; its group is played again (refill 1 of 1)"
    out, health = _play(engine, how, bad=100, refills=1)  # it always fails: the reason comes back for dead-letter
    assert out == [reason, reason]
    assert health == EnvironmentHealth(ok=0, failed=8, timed_out=0, refilled=2)


def test_a_hung_environment_times_out_at_its_deadline_and_the_producer_goes_on(engine):
    started = time.monotonic()
    out, health = _play(engine, "hang", bad=100, refills=0, deadline_s=0.3)
    assert time.monotonic() - started < 5
    assert all(r.startswith("environment timed out: environment Flaky step timed out after 0.3 s") for r in out)
    assert health == EnvironmentHealth(ok=0, failed=0, timed_out=4, refilled=0)
    out, health = _play(engine, "hang", bad=1, refills=1, deadline_s=0.3)
    assert all(isinstance(group, list) for group in out) and health.timed_out == 2 and health.ok == 4


def test_a_huge_reply_ends_the_episode_at_the_budget_without_being_tokenised(engine):
    started = time.monotonic()
    out, health = _play(engine, "huge", bad=100, refills=0)
    assert time.monotonic() - started < 5
    assert all(e.finish_reason == "length" and len(e.texts) == 1 for group in out for e in group)
    assert health.ok == 4


def test_call_with_deadline_passes_values_and_errors_through():
    assert call_with_deadline(lambda: 7, 1.0, "x") == 7
    with pytest.raises(KeyError):
        call_with_deadline(lambda: {}["k"], 1.0, "x")
    with pytest.raises(EnvironmentTimeout, match="environment slow step timed out after 0.05 s"):
        call_with_deadline(lambda: RELEASE.wait(60), 0.05, "slow step")


def test_status_shows_each_environments_episodes_by_outcome_from_the_producers_newest_heartbeat():
    from rich.console import Console

    from schemas import Heartbeat
    from stream_rl.cli.status_cmd import _environments_table
    from stream_rl.operator_tools.status import environments, latest_per_instance

    def beat(role: str, instance: str, at: float, metrics: dict) -> Heartbeat:
        return Heartbeat(role=role, instance_id=instance, host="h", pid=1, state="ready", policy_version=3, step=1,
                         rates={}, metrics=metrics, open_alerts=[], interval_s=5.0, created_at=at)

    factory = EnvironmentFactory(lambda: None, "GuessDigit", 1.0, 1)
    factory.health = EnvironmentHealth(ok=14, failed=2, timed_out=4, refilled=3)
    beats = [beat("producer", "producer-0", 1.0, {"env/GuessDigit/ok": 2.0}),
             beat("producer", "producer-0", 2.0, {**factory.health_metrics(), "loop/tick_age_s": 0.1}),
             beat("producer", "producer-1", 2.0, {"producer/rollouts": 8.0}),  # single-turn: no environment
             beat("scorer", "scorer-0", 2.0, {"env/x/ok": 1.0})]
    envs = environments(latest_per_instance(beats))
    assert envs == {"producer-0": {"env/GuessDigit/failed": 2.0, "env/GuessDigit/ok": 14.0,
                                   "env/GuessDigit/refilled": 3.0, "env/GuessDigit/timed_out": 4.0}}
    console = Console(width=200, record=True)
    console.print(_environments_table(envs))
    lines = [line.split("│") for line in console.export_text().splitlines() if "producer-0" in line]
    assert [[cell.strip() for cell in line[1:-1]] for line in lines] == [
        ["producer-0", "GuessDigit", "14", "2", "4", "3", "-"]]  # "abandoned" is a driver's only
