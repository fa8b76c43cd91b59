"""`stream-rl run` with a gateway for agents, as the agent run tests start it (support.calc_agent's episodes in
tests/integration/test_gateway_run.py, the driver's verifiers episodes in tests/integration/test_driver_run.py): the
shared config (a tiny chat policy answering 6 tokens, groups of 4 episodes, agents' rewards passed through the
scorer, one group per step at lr 3e-3), a one-prompt file (the producers have one group to give, so the run reaches
its steps only with the agents' groups), the command line, and a free loopback port."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

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
{sections}"""
"""The run's config: ``port`` the gateway's, ``sections`` what a test adds (``[data]``, ``[driver]``)."""


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_command(tmp_path: Path, *, port: int, sections: str, broker, run_name: str, model: Path,
                steps: int) -> tuple[list[str], Path]:
    """The config, the one-prompt file and the run directory written under ``tmp_path``; ``(the stream-rl run
    command line, the run directory)``."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(port=port, sections=sections))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_id": "p0", "text": "2+3=", "answer": "5"}) + "\n")
    run_dir = tmp_path / "run"
    return ([sys.executable, "-m", "stream_rl.cli.main", "run", "-c", str(config), "--bootstrap", broker.bootstrap,
             "--run", run_name, "--max-steps", str(steps), "--set", f"run.prompts_file={prompts}",
             "--set", f"producer.model_dir={model}", "--set", f"trainer.model_dir={model}",
             "--set", f"run_dir={run_dir}"], run_dir)
