"""The driver's pure parts: episode ids, verifiers episodes read as outcomes (real verifiers ``Episode`` and
``Trace`` objects), the config's refusals, the event-loop watchdog, and the gateway client's bounded retries
(against support.hostile_http's scripted servers playing a gateway)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from support.hostile_http import Scripted, reply, serving

from producers.driver.gateway_client import GatewayClient, GatewayUnavailable
from producers.driver.role import episode_ids
from producers.driver.watchdog import watched
from producers.gateway.episodes import group_of
from schemas import ID_PATTERN

vf = pytest.importorskip("verifiers.v1", reason="verifiers is in the envs extra (make install-test installs it)")


def test_episode_ids_are_fixed_by_task_and_epoch_and_group_by_task():
    ids = episode_ids("vf_reverse", 3, 1, 4)
    assert ids == [f"vf-vf_reverse-3-e1/{k}" for k in range(4)]
    assert {group_of(i) for i in ids} == {"vf-vf_reverse-3-e1"}
    hub = episode_ids("owner/my task@1.0", 0, 0, 2)  # a hub id: its name, made safe for an episode id
    assert hub == ["vf-my-task-0-e0/0", "vf-my-task-0-e0/1"] and all(ID_PATTERN.match(i) for i in hub)
    assert len(group_of(episode_ids("x" * 300, 99999, 9999, 1)[0])) <= 64 + 20
    assert episode_ids("vf_reverse", 3, 1, 4, refills=2)[4:] == ["vf-vf_reverse-3-e1/4", "vf-vf_reverse-3-e1/5"]


def test_task_metadata_is_bounded_whatever_key_the_taskset_chose():
    from producers.driver.role import META_CHARS, task_metadata

    meta = task_metadata("owner/tasks@2", 7, "k" * 100_000, 3)
    assert meta["data_source"] == "verifiers/tasks" and meta["vf_index"] == "7" and meta["vf_epoch"] == "3"
    assert meta["vf_key"] == "k" * META_CHARS and all(len(v) <= META_CHARS for v in meta.values())


def _trace(rewards: dict, ok: bool = True, trainable: bool = True, errors=()):
    data = vf.TaskData(prompt="p", id="t")
    return vf.Trace(task=vf.TraceTask(type="Task", data=data, key="k", hash="h"),
                    agent=vf.AgentInfo(config=vf.AgentConfig(), name="agent", trainable=trainable),
                    rewards=rewards, ok=ok, errors=list(errors))


def _episode(traces, ok: bool = True, errors=()):
    from verifiers.v1.episode import Episode
    from verifiers.v1.trace import TraceTask

    return Episode(task=TraceTask(type="Task", data=vf.TaskData(prompt="p", id="t"), key="k", hash="h"),
                   traces=traces, ok=ok, errors=list(errors))


def test_a_verifiers_episode_is_read_as_its_rubrics_weighted_reward_or_the_reason_it_failed():
    from verifiers.v1.trace import Error, Reward

    from stream_rl.hubs.vf_agents import outcome_of

    scored = _trace({"exact": Reward(score=1.0, weight=1.0), "short": Reward(score=1.0, weight=0.5)})
    assert outcome_of(_episode([scored])).reward == 1.5  # 1 x 1 + 1 x 0.5, verifiers' weighted sum
    judge = _trace({"j": Reward(score=0.0)}, trainable=False)  # an untrainable judge's trace is not the agent's
    assert outcome_of(_episode([scored, judge])).reward == 1.5
    crashed = _episode([_trace({}, ok=False, errors=[Error(type="ToolError", message="the tool died")])], ok=False)
    assert outcome_of(crashed).reason == "the episode failed: ToolError: the tool died"
    assert outcome_of(crashed).reward is None
    timed = _episode([], ok=False, errors=[Error(type="TimeoutError", message="run() exceeded " + "x" * 900)])
    assert outcome_of(timed).reason.startswith("the episode failed: TimeoutError")
    assert len(outcome_of(timed).reason) == 500 and not outcome_of(timed).timed_out  # verifiers did not flag it
    assert "verifiers marked the episode not ok" in outcome_of(_episode([], ok=False)).reason
    two = _episode([scored, _trace({"r": Reward(score=1.0)})])
    assert outcome_of(two).reason == "the episode has 2 trainable traces; one is trained per episode"
    assert outcome_of(_episode([_trace({"r": None})])).reason == "verifiers scored no reward (r unscored)"
    assert outcome_of(_episode([_trace({})])).reason == "verifiers scored no reward (the task has none)"
    bad = outcome_of(_episode([_trace({"r": Reward(score=math.inf)})]))
    assert bad.reward is None and "non-finite" in bad.reason


@pytest.mark.parametrize(("overrides", "words"), [
    ({"driver.environment": "reasoning-gym:basic_arithmetic", "driver.gateway_url": "http://h:1/v1"},
     "write verifiers:TASKSET_ID?size=N"),
    ({"driver.environment": "verifiers:t"}, "a [driver] needs a gateway to play through"),
    ({"driver.environment": "verifiers:t", "gateway.port": 0}, "gateway.port = 0"),
    ({"driver.environment": "verifiers:t", "driver.gateway_url": "http://h:1/v1", "driver.epochs": 0}, "epochs"),
])
def test_impossible_driver_settings_are_refused_at_load_naming_the_fields(overrides, words):
    from stream_rl.cli.config import load_config
    from stream_rl.config.base import ConfigError

    with pytest.raises(ConfigError, match="driver") as caught:
        load_config(None, env={}, overrides=overrides)
    assert words in str(caught.value)


def test_a_driver_with_the_runs_gateway_is_accepted():
    from stream_rl.cli.config import load_config
    from stream_rl.cli.drive_cmd import gateway_url_of

    cfg = load_config(None, env={}, overrides={"driver.environment": "verifiers:t", "gateway.port": 8123,
                                                "gateway.host": "0.0.0.0"})
    assert cfg.driver.agent == {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
    assert gateway_url_of(cfg) == "http://127.0.0.1:8123/v1"


def test_the_watchdog_calls_out_a_blocked_loop_and_not_an_awaiting_one():
    called: list[float] = []

    async def body(block: bool) -> None:
        async with watched(0.4, on_blocked=called.append):
            if block:
                time.sleep(1.2)  # what a synchronous call in an async reward does to the loop
            else:
                await asyncio.sleep(1.2)

    asyncio.run(body(False))
    assert called == []
    asyncio.run(body(True))
    assert len(called) == 1 and called[0] > 0.4


def _answers(answers: list[tuple[int, dict]]) -> Scripted:
    """A loopback server answering each request with the next (status, body) of ``answers``; the last repeats."""
    return Scripted(lambda handler, n: reply(handler, *answers[min(n, len(answers)) - 1]))


def _asked(server: Scripted) -> list[str]:
    return [f"{seen['method']} {seen['path']}" for seen in server.seen]


def test_the_gateway_client_retries_only_what_is_retriable_and_names_the_reason():
    busy = {"error": {"message": "too many connections"}}
    server = _answers([(503, busy), (503, busy), (200, {"episode_id": "g/0", "state": "new", "members": 0,
                                                             "refills_waiting": 0})])
    with serving(server) as url:
        client = GatewayClient(url + "v1", backoff_s=0.01)
        assert client.state("g/0")["state"] == "new" and _asked(server) == ["GET /v1/episodes/g%2F0"] * 3
    server = _answers([(409, {"error": {"message": "episode 'g/0' is published"}})])
    with serving(server) as url, pytest.raises(GatewayUnavailable,
                                               match="HTTP 409: episode 'g/0' is published") as caught:
        GatewayClient(url + "v1", backoff_s=0.01).end("g/0", {"reward": 1.0})
    assert caught.value.status == 409 and len(server.seen) == 1  # not retried
    server = _answers([(503, busy)])
    with serving(server) as url, pytest.raises(GatewayUnavailable, match="no answer after 3 attempts: HTTP 503"):
        GatewayClient(url + "v1", attempts=3, backoff_s=0.01).health()
    assert len(server.seen) == 3
    server = _answers([(200, {"status": "ok"})])  # another server's /health (a vLLM server's, say)
    with serving(server) as url, pytest.raises(
            GatewayUnavailable, match="not a stream-rl gateway's answer .no version, group_size, model"):
        GatewayClient(url + "v1", backoff_s=0.01).health()
    server = _answers([(200, {"version": True, "group_size": 4, "model": "m"})])
    with serving(server) as url, pytest.raises(GatewayUnavailable, match="no version of the expected type"):
        GatewayClient(url + "v1", backoff_s=0.01).health()
    # serving() has closed the last server: nothing listens at its URL any more
    with pytest.raises(GatewayUnavailable, match="no answer after 2 attempts") as gone:
        GatewayClient(url + "v1", attempts=2, backoff_s=0.01).health()
    assert gone.value.status is None


def test_the_drivers_heartbeat_shows_in_the_environments_table_beside_the_producers():
    from rich.console import Console

    from producers.driver.health import metrics
    from producers.driver.role import Summary
    from schemas import Heartbeat
    from stream_rl.cli.status_cmd import _environments_table
    from stream_rl.operator_tools.status import environments, latest_per_instance

    summary = Summary(groups=5, rewarded=12, failed=7, skipped=1, abandoned=2, timed_out=3, refilled=5)
    assert metrics("verifiers:vf_digits", summary) == {
        "env/verifiers:vf_digits/ok": 12.0, "env/verifiers:vf_digits/failed": 4.0,  # 7 failed, 3 of them on a deadline
        "env/verifiers:vf_digits/timed_out": 3.0, "env/verifiers:vf_digits/refilled": 5.0,
        "env/verifiers:vf_digits/abandoned": 2.0}
    beats = [Heartbeat(role=role, instance_id=instance, host="h", pid=1, state="ready", policy_version=3, step=5,
                       rates={}, metrics=values, open_alerts=[], interval_s=5.0, created_at=2.0)
             for role, instance, values in [("driver", "driver-0", metrics("verifiers:vf_digits", summary)),
                                            ("producer", "producer-0",
                                             {"env/Guess/ok": 1.0, "env/Guess/refilled": 2.0})]]
    envs = environments(latest_per_instance(beats))
    assert set(envs) == {"driver-0", "producer-0"}
    console = Console(width=200, record=True)
    console.print(_environments_table(envs))
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in console.export_text().splitlines()
            if "-0 " in line]
    assert ["driver-0", "verifiers:vf_digits", "12", "4", "3", "5", "2"] in rows
    assert ["producer-0", "Guess", "1", "-", "-", "2", "-"] in rows  # what its heartbeat lacks shows as '-'

