"""The gateway through `stream-rl run` on the real broker, the worked example of issue 42 on CPU: a ``[gateway]``
section starts it beside the other roles; the tool-using agent of support.calc_agent (the plain ``openai`` client)
plays groups of episodes against it, one group per policy version; their rewards pass through the scorer
(``stream_rl.rewards.given:episode_reward``, routed on ``reward_source``) and the trainer trains on them: the run
reaches its steps only with the gateway's groups (the producers have one group to give), and the agent's reward
rises.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from support.agent_runs import free_port, run_command
from support.calc_agent import play
from support.chat import TOOLS_TEMPLATE
from support.chat_model import build_chat_model_dir
from support.topics import read_records

pytestmark = pytest.mark.broker

SECTIONS = """
[data]
chat_template = "{template}"
"""
GROUPS, EPISODES = 16, 4


def _wait_healthy(url: str, run: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert run.poll() is None, run.communicate()[0][-3000:]
        try:
            with urllib.request.urlopen(url.replace("/v1", "/health"), timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the gateway did not answer at {url} within {timeout_s}s")


def _version(url: str) -> int:
    with urllib.request.urlopen(url.replace("/v1", "/health"), timeout=10) as health:
        return json.loads(health.read())["version"]


def _play_groups(url: str) -> list[float]:
    """One group of episodes per policy version (the agent waits for the next version, as an on-policy agent
    would); each group's mean reward."""
    means = []
    for group in range(GROUPS):
        rewards = [0.0] * EPISODES
        version = _version(url)

        def one(i: int) -> None:
            rewards[i] = play(url, f"g{group}/{i}", seed=100 * group + i)

        agents = [threading.Thread(target=one, args=(i,)) for i in range(EPISODES)]
        for agent in agents:
            agent.start()
        for agent in agents:
            agent.join(120)
        means.append(sum(rewards) / EPISODES)
        deadline = time.monotonic() + 60
        while group < GROUPS - 1 and _version(url) <= version and time.monotonic() < deadline:
            time.sleep(0.2)
    return means


@pytest.mark.slow
def test_a_tool_using_agent_trains_through_stream_rl_run_and_its_reward_rises(broker, tmp_path, run_name, make_config):
    from stream_rl.transport.client import Transport

    model = build_chat_model_dir(tmp_path / "policy")
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    port = free_port()
    command, run_dir = run_command(tmp_path, port=port, sections=SECTIONS.format(template=template), broker=broker,
                                   run_name=run_name, model=model, steps=GROUPS + 1)
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}/v1"
        _wait_healthy(url, run)
        means = _play_groups(url)
        output, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, output[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows if "step" in row][-1] == GROUPS + 1
    print("agent reward per group", [round(m, 3) for m in means])
    assert sum(means[-4:]) / 4 > sum(means[:4]) / 4 + 0.25, means  # the agent's own reward rises
    cfg = make_config()
    transport = Transport(cfg, "test")
    scored = [r.value for r in read_records(transport, transport.names.scored, "scored_rollout")]
    agents = [s for s in scored if s.rollout.metadata.get("reward_source") == "agent"]
    assert {s.rollout.prompt_id for s in agents} == {f"g{g}" for g in range(GROUPS)}
    assert all(s.reward == float(s.rollout.metadata["episode_reward"]) for s in agents)  # passed through as given
    assert {s.rollout.metadata["episode_id"] for s in agents} == {f"g{g}/{i}" for g in range(GROUPS)
                                                                  for i in range(EPISODES)}
    assert Path(run_dir / "logs" / "gateway-0.log").exists()
