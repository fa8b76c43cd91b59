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
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.chat_model import build_chat_model_dir
from support.paths import VF_TASKSETS
from support.topics import read_records

pytestmark = pytest.mark.broker

CONFIG = """
[run]
demo_dir = "none"
epochs = 1
group_size = 2

[producer]
max_new_tokens = 6

[gateway]
port = {port}
group_size = 4
weights_check_s = 0.3

[driver]
environment = "verifiers:vf_digits?size={groups}"
wait_for_version_s = 60
episode_timeout_s = 120

[scorer.rewards]
by = "reward_source"
default = [{{fn = "contains_answer", weight = 1.0}}]

[scorer.rewards.routes]
agent = [{{fn = "stream_rl.rewards.given:episode_reward", weight = 1.0}}]

[trainer]
groups_per_step = 1
micro_batch_size = 8
max_lag = 4
checkpoint_every = 1000
lr = 3e-3
"""
GROUPS = 12


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_verifiers_environment_trains_through_the_driver_in_stream_rl_run(broker, tmp_path, run_name, make_config):
    from stream_rl.transport.client import Transport

    model = build_chat_model_dir(tmp_path / "policy")
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(port=_free_port(), groups=GROUPS))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_id": "p0", "text": "2+3=", "answer": "5"}) + "\n")
    run_dir = tmp_path / "run"
    pythonpath = os.pathsep.join(filter(None, [str(VF_TASKSETS), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "stream_rl.cli.main", "run", "-c", str(config), "--bootstrap", broker.bootstrap,
         "--run", run_name, "--max-steps", str(GROUPS + 1), "--set", f"run.prompts_file={prompts}",
         "--set", f"producer.model_dir={model}", "--set", f"trainer.model_dir={model}",
         "--set", f"run_dir={run_dir}"], capture_output=True, text=True, cwd=tmp_path, timeout=600,
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
