"""The driver (issue 42, section 2: verifiers environments by their own agent loop): verifiers' chat-loop harness
runs as a program of its own (``uv``-prepared, in verifiers' subprocess runtime), calls the model through verifiers'
interception, which relays to a real gateway on the real broker with the episode id; each episode ends with
verifiers' own reward, and the gateway publishes the groups as rollouts. A restarted driver neither replays nor
loses an episode, and keeps the refills promised before it died; failing environments are dead-lettered with their
reason, and a failed episode is replaced by a spare of its group while spares last.

A tiny chat policy (support.chat_model) on the hf engine behind a gateway thread; tasksets of
tests/support/vf_tasksets.
"""

from __future__ import annotations

import json
import threading

import openai
import pytest
import torch
from support.chat_model import build_chat_model_dir
from support.gateway import end_episode, start_gateway
from support.paths import VF_TASKSETS
from support.producers import collect
from support.topics import read_records

pytestmark = pytest.mark.broker
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from producers.engines.hf import HFEngine

    model = build_chat_model_dir(tmp_path_factory.mktemp("driver-policy") / "policy")
    engine = HFEngine.from_dir(model)
    yield model, engine
    engine.close()


@pytest.fixture
def gateway(make_config, policy, monkeypatch):
    """A gateway thread on this test's run (groups of 2): ``(url, cfg)``."""
    monkeypatch.syspath_prepend(str(VF_TASKSETS))
    model, engine = policy
    cfg = make_config(**{"producer.model_dir": str(model), "producer.max_new_tokens": 6,
                         "producer.follow_weights": False, "gateway.port": 0, "gateway.group_size": 2,
                         "gateway.sweep_interval_s": 0.2})
    running = start_gateway(cfg, engine)
    yield running.url, cfg
    running.finish()
    assert running.error is None, running.error


def _driver(url: str, environment: str, **fields):
    from producers.driver.config import DriverConfig

    return DriverConfig(environment=environment, gateway_url=url, **fields)


def _calls(cfg) -> dict[str, list]:
    from schemas import GatewayCall, decode
    from stream_rl.transport.client import Transport

    transport = Transport(cfg, "test")
    out: dict[str, list] = {}
    for record in read_records(transport, transport.names.name("gateway"), None):
        message = decode(record.value)
        if isinstance(message, GatewayCall):
            out.setdefault(message.episode_id, []).append(message)
    return out


def test_verifiers_episodes_play_through_the_gateway_and_end_with_their_own_reward(gateway):
    from producers.driver.role import run_driver
    from stream_rl.hubs.vf import verifiers_reward
    from stream_rl.transport.client import Transport

    url, cfg = gateway
    summary = run_driver(_driver(url, "verifiers:vf_reverse?size=3"))
    assert (summary.groups, summary.rewarded, summary.failed, summary.skipped) == (3, 6, 0, 0), summary
    transport = Transport(cfg, "test")
    rollouts = [r.value for r in collect(transport, transport.names.rollouts, want=6, timeout_s=30)]
    calls = _calls(cfg)
    assert set(calls) == {f"vf-vf_reverse-{i}-e0/{k}" for i in range(3) for k in range(2)}
    for rollout in rollouts:
        meta = rollout.metadata
        episode = meta["episode_id"]
        (call,) = calls[episode]  # verifiers' chat loop: one model call per episode on a task without tools
        sent = json.loads(call.messages_json)
        assert sent[-1] == {"role": "user", "content": f"Reverse: {('abc', 'hello', 'stream')[int(meta['vf_index'])]}"}
        assert rollout.prompt_id == episode.split("/")[0] and meta["reward_source"] == "agent"
        assert (meta["data_source"], meta["vf_taskset"], meta["vf_epoch"]) == (
            "verifiers/vf_reverse", "vf_reverse", "0")
        # the reward the driver ended it with is verifiers' rubric over the answer the gateway recorded
        again = verifiers_reward("", call.response_text, None, {**meta, "vf_size": "3"})
        assert float(meta["episode_reward"]) == pytest.approx(again), (call.response_text, meta)
    print("rewards", sorted(float(r.metadata["episode_reward"]) for r in rollouts))


def _letters(cfg) -> dict[str, object]:
    from schemas import decode
    from stream_rl.transport.client import Transport

    transport = Transport(cfg, "test")
    return {(letter := decode(r.value)).raw_key.decode(): letter
            for r in read_records(transport, transport.names.dlq, None)}


def test_failing_environments_are_dead_lettered_with_their_reason_and_never_trained(gateway):
    from producers.driver.role import run_driver
    from stream_rl.transport.client import Transport

    url, cfg = gateway
    summary = run_driver(_driver(url, "verifiers:vf_hostile?size=4", episode_timeout_s=8.0, refills=0))
    assert (summary.groups, summary.rewarded, summary.failed) == (4, 2, 6), summary
    letters = _letters(cfg)
    reasons = {episode.split("/")[0]: letter.reason for episode, letter in letters.items()}
    assert set(letters) == {f"vf-vf_hostile-{i}-e0/{k}" for i in (1, 2, 3) for k in (0, 1)}
    assert "RuntimeError" in reasons["vf-vf_hostile-1-e0"] and "the grader crashed" in reasons["vf-vf_hostile-1-e0"]
    assert "outlasted 8s (driver.episode_timeout_s)" in reasons["vf-vf_hostile-2-e0"]
    assert "nan" in reasons["vf-vf_hostile-3-e0"].lower()
    assert all(letter.error_type == "AgentFailed" for letter in letters.values())
    transport = Transport(cfg, "test")
    rollouts = [r.value for r in collect(transport, transport.names.rollouts, want=2, timeout_s=30)]
    assert {r.prompt_id for r in rollouts} == {"vf-vf_hostile-0-e0"}  # only the group that scored trains
    assert {r.metadata["episode_reward"] for r in rollouts} == {"1.0"}
    assert len(read_records(transport, transport.names.rollouts, None)) == 2


def test_a_harness_that_cannot_start_is_dead_lettered_before_any_call_and_stops_the_driver(gateway):
    from producers.driver.role import DriverError, run_driver

    url, cfg = gateway
    agent = {"harness": {"id": "null"}, "runtime": {"type": "docker"}}  # no Docker engine runs here
    with pytest.raises(DriverError, match="2 episodes failed in a row") as stopped:
        run_driver(_driver(url, "verifiers:vf_reverse?size=3", agent=agent, max_failed_in_a_row=2))
    assert "docker" in str(stopped.value)  # the last reason, as verifiers gave it
    letters = _letters(cfg)
    assert set(letters) == {f"vf-vf_reverse-0-e0/{k}" for k in (0, 1, 2)}  # /2: the group's spare (refills=1)
    assert all("before any call" in letter.reason for letter in letters.values())
    assert ["refilled" in letters[f"vf-vf_reverse-0-e0/{k}"].reason for k in (0, 1, 2)] == [True, False, False]
    assert _calls(cfg) == {}


def test_a_restarted_driver_neither_replays_nor_loses_an_episode_and_keeps_the_refills_promised(gateway):
    from producers.driver.role import run_driver
    from stream_rl.transport.client import Transport

    url, cfg = gateway
    hello = [{"role": "user", "content": "Reverse: abc"}]
    for episode in ("vf-vf_reverse-0-e0/0", "vf-vf_reverse-0-e0/1", "vf-vf_reverse-1-e0/0"):  # a dead driver's
        openai.OpenAI(base_url=url, api_key=episode, max_retries=0).chat.completions.create(
            model="policy", messages=hello)
    end_episode(url, "vf-vf_reverse-0-e0/1", {"reward": 0.25})  # group 0: one ended, the other left open
    promised = end_episode(url, "vf-vf_reverse-1-e0/0", {"failed": "its tool crashed", "refill": True})
    assert (promised["state"], promised["members"], promised["refills_waiting"]) == ("dead_lettered", 0, 1)
    first = run_driver(_driver(url, "verifiers:vf_reverse?size=2"))  # refills=1: one spare id per group, /2
    assert (first.groups, first.rewarded, first.failed, first.refilled, first.abandoned, first.skipped) == (
        2, 3, 1, 1, 1, 2), first  # group 0: /0 abandoned and replaced by /2; group 1: /1 and the promised /2
    letters = _letters(cfg)
    assert set(letters) == {"vf-vf_reverse-0-e0/0", "vf-vf_reverse-1-e0/0"}
    assert "the driver restarted while the episode was open" in letters["vf-vf_reverse-0-e0/0"].reason
    assert all("(refilled: another episode of its group takes its place)" in x.reason for x in letters.values())
    again = run_driver(_driver(url, "verifiers:vf_reverse?size=2"))
    assert (again.rewarded, again.failed, again.skipped) == (0, 0, 4)  # everything is closed: nothing replayed
    transport = Transport(cfg, "test")
    rollouts = [r.value for r in collect(transport, transport.names.rollouts, want=4, timeout_s=30)]
    by_group = {}
    for rollout in rollouts:
        by_group.setdefault(rollout.prompt_id, []).append(rollout.metadata["episode_id"])
    assert {g: sorted(e) for g, e in by_group.items()} == {
        f"vf-vf_reverse-{i}-e0": [f"vf-vf_reverse-{i}-e0/1", f"vf-vf_reverse-{i}-e0/2"] for i in (0, 1)}
    assert {e: len(c) for e, c in _calls(cfg).items()} == {  # each episode called once: none was played twice
        f"vf-vf_reverse-{i}-e0/{k}": 1 for i in (0, 1) for k in (0, 1, 2)}


def test_a_failed_episode_is_replaced_by_a_spare_and_its_group_trains_whole(gateway, tmp_path, monkeypatch):
    from producers.driver.gateway_client import GatewayClient
    from producers.driver.role import run_driver
    from stream_rl.transport.client import Transport

    url, cfg = gateway
    monkeypatch.setenv("VF_HOSTILE_TASKS", "flaky")  # its first grading raises, the later ones give 1
    monkeypatch.setenv("VF_FLAKY_FILE", str(tmp_path / "graded-once"))
    summary = run_driver(_driver(url, "verifiers:vf_hostile?size=1"))
    assert (summary.groups, summary.rewarded, summary.failed, summary.refilled) == (1, 2, 1, 1), summary
    (failed, letter), = _letters(cfg).items()
    assert failed in ("vf-vf_hostile-0-e0/0", "vf-vf_hostile-0-e0/1")
    assert "the grader failed once" in letter.reason and "(refilled:" in letter.reason
    transport = Transport(cfg, "test")
    rollouts = [r.value for r in collect(transport, transport.names.rollouts, want=2, timeout_s=30)]
    assert sorted(r.metadata["episode_id"] for r in rollouts) == sorted(
        {"vf-vf_hostile-0-e0/0", "vf-vf_hostile-0-e0/1", "vf-vf_hostile-0-e0/2"} - {failed})
    assert {r.metadata["episode_reward"] for r in rollouts} == {"1.0"} and {r.group_size for r in rollouts} == {2}
    answer = GatewayClient(url).state(failed)
    assert (answer["members"], answer["refills_waiting"]) == (2, 0)


def test_a_stopped_driver_ends_its_episodes_in_play_as_failed(gateway):
    from producers.driver.gateway_client import GatewayClient
    from producers.driver.role import run_driver
    from support.waiting import wait_for

    url, cfg = gateway
    stop, out = threading.Event(), {}
    thread = threading.Thread(target=lambda: out.update(summary=run_driver(
        _driver(url, "verifiers:vf_hostile?size=3", episode_timeout_s=120.0), stop)))
    thread.start()
    client = GatewayClient(url)
    wait_for(lambda: all(client.state(f"vf-vf_hostile-2-e0/{k}")["state"] == "open" for k in (0, 1)),
             timeout_s=120, what="the hanging task's episodes in play")
    stop.set()
    thread.join(30)
    assert not thread.is_alive()
    summary = out["summary"]
    assert (summary.groups, summary.rewarded, summary.failed, summary.refilled) == (3, 2, 5, 1), summary
    letters = _letters(cfg)
    assert {letters[f"vf-vf_hostile-2-e0/{k}"].reason for k in (0, 1)} == {  # no refill promised on a stop
        "the agent ended the episode as failed: the driver was stopped"}
    assert ["refilled" in letters[f"vf-vf_hostile-1-e0/{k}"].reason for k in (0, 1, 2)] == [True, False, False]
    assert {client.state(f"vf-vf_hostile-2-e0/{k}")["state"] for k in (0, 1)} == {"dead_lettered"}


def test_environment_code_that_blocks_the_event_loop_ends_the_driver_with_the_reason(gateway, tmp_path):
    import os
    import subprocess
    import sys
    import time

    from producers.driver.gateway_client import GatewayClient

    url, cfg = gateway
    config = tmp_path / "drive.toml"
    config.write_text('[driver]\nenvironment = "verifiers:vf_hostile?size=2"\nepisode_timeout_s = 5.0\n')
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "stream_rl.cli.main", "drive", "-c", str(config), "--gateway", url],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "VF_HOSTILE_TASKS": "ok,blocks", "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(VF_TASKSETS), os.environ.get("PYTHONPATH")]))})
    took = time.monotonic() - started
    assert result.returncode == 70, result.stderr[-3000:]
    assert "its event loop was blocked for" in result.stderr and "restarted driver ends them as failed" in result.stderr
    client = GatewayClient(url)
    assert {client.state(f"vf-vf_hostile-1-e0/{k}")["state"] for k in (0, 1)} == {"open"}  # left for a restart
    assert client.state("vf-vf_hostile-0-e0/0")["state"] == "published"
    print(f"the blocked driver exited after {took:.1f}s in all (its watchdog: 10 s)")


def test_the_driver_refuses_what_it_cannot_play_with_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from stream_rl.cli.main import app

    monkeypatch.syspath_prepend(str(VF_TASKSETS))
    monkeypatch.chdir(tmp_path)

    def drive(text: str, *args: str):
        (tmp_path / "drive.toml").write_text(text)
        result = CliRunner().invoke(app, ["drive", "-c", "drive.toml", *args], env={"STREAM_RL_CONFIG": ""})
        return result.exit_code, result.output.strip()

    gateway = ("--gateway", "http://127.0.0.1:9/v1")  # nothing listens there
    code, out = drive("[run]\nepochs = 1\n")
    assert code == 2 and "no [driver] section" in out
    code, out = drive('[driver]\nenvironment = "reasoning-gym:basic_arithmetic"\n', *gateway)
    assert code == 2 and "write verifiers:TASKSET_ID?size=N" in out
    code, out = drive('[driver]\nenvironment = "verifiers:vf_reverse"\n')
    assert code == 2 and "a [driver] needs a gateway" in out
    code, out = drive('[driver]\nenvironment = "verifiers:vf_reverse"\n[gateway]\nport = 0\n')
    assert code == 2 and "gateway.port = 0" in out
    code, out = drive('[driver]\nenvironment = "verifiers:no_such_taskset"\n', *gateway)
    assert code == 2 and out.startswith("driver.environment: verifiers cannot load") and "no_such_taskset" in out
    assert len(out.splitlines()) == 1, out
    code, out = drive('[driver]\nenvironment = "verifiers:vf_badload?size=3"\n', *gateway)
    assert code == 2 and len(out.splitlines()) == 1, out
    assert "failed while listing its tasks (after 1): OSError: the task database is gone" in out
    code, out = drive('[driver]\nenvironment = "verifiers:vf_reverse"\nagent = {harness = {id = "no-such-harness"}}\n',
                      *gateway)
    assert code == 2 and "no-such-harness" in out and len(out.splitlines()) == 1, out
    code, out = drive('[driver]\nenvironment = "verifiers:vf_duo"\n', *gateway)  # two agent seats
    assert code == 2 and "declares agents critic, solver: the driver plays single-agent environments" in out
    code, out = drive('[driver]\nenvironment = "verifiers:vf_reverse"\nagent = {max_turns = "many"}\n', *gateway)
    assert code == 2 and "ValidationError" in out and "max_turns" in out and len(out.splitlines()) == 1, out
    code, out = drive('[driver]\nenvironment = "verifiers:vf_reverse"\ngateway_wait_s = 1\n', *gateway)
    assert code == 1 and out.startswith("driver stopped: GET http://127.0.0.1:9/health: no answer"), out
