"""The driver through `stream-rl run` on the real broker (issue 42, section 2): a ``[driver]`` section starts it
beside a ``[gateway]``; verifiers' own agent loop (its chat-loop harness in verifiers' subprocess runtime) plays a
verifiers taskset (support vf_digits) through the gateway, one group per policy version; each episode's reward is
the taskset's own ``@vf.reward``, passed through the scorer (``stream_rl.rewards.given:episode_reward``) to the
trainer. The run reaches its steps only with the driver's groups (the producers have one group to give), and the
verifiers reward rises.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from support.agent_runs import free_port, run_command
from support.chat_model import build_chat_model_dir
from support.paths import VF_TASKSETS
from support.topics import read_records

pytestmark = pytest.mark.broker

DRIVER = """
[driver]
environment = "verifiers:vf_digits?size={groups}"
wait_for_version_s = 60
episode_timeout_s = 120
"""
GROUPS = 12


@pytest.mark.slow
def test_a_verifiers_environment_trains_through_the_driver_in_stream_rl_run(broker, tmp_path, run_name, make_config):
    from stream_rl.transport.client import Transport

    model = build_chat_model_dir(tmp_path / "policy")
    command, run_dir = run_command(tmp_path, port=free_port(), sections=DRIVER.format(groups=GROUPS), broker=broker,
                                   run_name=run_name, model=model, steps=GROUPS + 1)
    pythonpath = os.pathsep.join(filter(None, [str(VF_TASKSETS), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath})
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in rows if "step" in row][-1] == GROUPS + 1
    transport = Transport(make_config(), "test")
    scored = [r.value for r in read_records(transport, transport.names.scored, "scored_rollout")]
    driven = [s for s in scored if s.rollout.metadata.get("data_source") == "verifiers/vf_digits"]
    assert {s.rollout.prompt_id for s in driven} == {f"vf-vf_digits-{i}-e0" for i in range(GROUPS)}
    assert all(s.reward == float(s.rollout.metadata["episode_reward"]) for s in driven)  # verifiers' reward
    assert all(s.rollout.metadata["reward_source"] == "agent" for s in driven)
    means = []
    for i in range(GROUPS):
        own = [s.reward for s in driven if s.rollout.metadata["vf_index"] == str(i)]
        assert len(own) == 4, (i, own)
        means.append(sum(own) / len(own))
    print("verifiers reward per group", [round(m, 3) for m in means])
    assert sum(means[-4:]) / 4 > sum(means[:4]) / 4 + 0.25, means
    beats = [r.value for r in read_records(transport, transport.names.status, "heartbeat") if r.value.role == "driver"]
    assert beats and beats[-1].metrics["env/verifiers:vf_digits/ok"] == 4.0 * GROUPS  # stream-rl status shows it
    assert beats[-1].metrics["env/verifiers:vf_digits/failed"] == 0.0 and beats[-1].step == GROUPS
    log = (run_dir / "logs" / "drive-0.log").read_text()
    assert "driver done: 12 group(s), 48 episode(s) rewarded" in log, log[-2000:]
