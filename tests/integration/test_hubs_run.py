"""Environment hubs through `stream-rl run` on the real broker, one short CPU run per hub (issue 42, section 2):
the tiny chat policy (support.chat_model, a character tokenizer that spells every printable character), a few
steps, and the hub's own verifier as the reward. Each run checks that its scored rollouts came from the hub and
were scored by it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.chat_model import build_chat_model_dir
from support.paths import TESTS_DIR, VF_TASKSETS
from support.topics import read_records, read_values

pytestmark = pytest.mark.broker

CONFIG = """
[run]
demo_dir = "none"
epochs = 1
group_size = 2

[producer]
max_new_tokens = 6
prompts_per_batch = 4
max_groups_per_version = 2
{producer}

[scorer]
{scorer}

[trainer]
groups_per_step = 2
micro_batch_size = 8
max_lag = 2
checkpoint_every = 100
"""
STEPS = 2


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    """The tiny chat policy, built once for the hub runs."""
    return build_chat_model_dir(tmp_path_factory.mktemp("hubs") / "policy")


def _run(tmp_path: Path, broker, run_name: str, policy: Path, prompts: str, producer: str = "",
         scorer: str = "", path: Path | None = None, sets: tuple[str, ...] = ()) -> list[dict]:
    """`stream-rl run` for STEPS steps (``path``: a folder the roles import from); its step rows (asserting it
    exited 0)."""
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(producer=producer, scorer=scorer))
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "stream_rl.cli.main", "run", "-c", str(config), "--bootstrap", broker.bootstrap,
         "--run", run_name, "--max-steps", str(STEPS), "--set", f"run.prompts_file={prompts}",
         "--set", f"producer.model_dir={policy}", "--set", f"trainer.model_dir={policy}",
         "--set", f"run_dir={run_dir}", *[arg for item in sets for arg in ("--set", item)]],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1",
             **({"PYTHONPATH": os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))}
                if path else {})})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [row for row in rows if "step" in row]
    assert steps[-1]["step"] == STEPS
    return steps


def _scored(make_config) -> list:
    from stream_rl.transport.client import Transport

    transport = Transport(make_config(), "test")
    return [r.value for r in read_records(transport, transport.names.scored, "scored_rollout")]


def test_reasoning_gym_prompts_train_through_stream_rl_run_scored_by_its_own_verifier(
        broker, tmp_path, run_name, policy, make_config):
    pytest.importorskip("reasoning_gym", reason="the envs extra is not installed: pip install -e '.[envs]'")
    _run(tmp_path, broker, run_name, policy, "reasoning-gym:basic_arithmetic?size=8&seed=1&max_terms=2",
         scorer='reward_fn = "reasoning_gym"')
    scored = _scored(make_config)
    assert len(scored) >= STEPS * 2 * 2
    assert all(s.rollout.metadata["rg_dataset"] == "basic_arithmetic" for s in scored)
    assert all(s.rollout.prompt_id.startswith("rg-basic_arithmetic-1-") for s in scored)
    assert all(0.0 <= s.reward <= 1.0 for s in scored)


def test_a_verifiers_taskset_trains_through_stream_rl_run_scored_by_its_own_rewards(
        broker, tmp_path, run_name, policy, make_config):
    pytest.importorskip("verifiers.v1", reason="the envs extra is not installed: pip install -e '.[envs]'")
    _run(tmp_path, broker, run_name, policy, "verifiers:vf_reverse?size=6", scorer='reward_fn = "verifiers"',
         path=VF_TASKSETS)
    scored = _scored(make_config)
    assert len(scored) >= STEPS * 2 * 2
    assert all(s.rollout.metadata["vf_taskset"] == "vf_reverse" for s in scored)
    assert all(s.reward in (0.0, 0.5, 1.0, 1.5) for s in scored)  # 1 x reversed + 0.5 x short
    assert any(s.reward >= 0.5 for s in scored)  # the tiny policy's turns are short


@pytest.mark.parametrize("where", ["in-process", "served"])
def test_an_openenv_environment_trains_through_stream_rl_run_rewarded_by_its_rubric(
        broker, tmp_path, run_name, policy, make_config, where):
    """The same OpenEnv class, imported by the producer or served by openenv-core's own server over WebSocket
    (``producer.environment = "openenv+http://..."``, producers.openenv_remote)."""
    pytest.importorskip("openenv.core", reason="the envs extra is not installed: pip install -e '.[envs]'")
    from support.openenv_server import served

    with contextlib.ExitStack() as stack:
        reference = "openenv:support.openenv_guess:GuessDigit"
        if where == "served":
            url, _ = stack.enter_context(served("GuessDigit"))
            reference = f"openenv+{url}"
        _openenv_run(tmp_path, broker, run_name, policy, reference)
    _assert_rubric_rewarded(make_config)


def _openenv_run(tmp_path, broker, run_name, policy, reference: str) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_id": f"g{i}", "text": "Guess a digit:"}) + "\n"
                               for i in range(4)))
    _run(tmp_path, broker, run_name, policy, str(prompts), path=TESTS_DIR,
         producer=f'environment = "{reference}"\nmax_turns = 2\nenv_timeout_s = 10',
         scorer='reward_fn = "stream_rl.rewards.given:episode_reward"\non_reward_error = "zero"',
         sets=("producer.max_new_tokens=48",))


def _assert_rubric_rewarded(make_config) -> None:
    scored = _scored(make_config)
    assert len(scored) >= STEPS * 2 * 2
    stepped = [s for s in scored if "episode_reward" in s.rollout.metadata]  # the others ended in turn 1 (scored 0)
    assert stepped
    for s in stepped:  # the environment's rubric, passed through: 1 right, 0.1 a digit, 0 anything else per guess
        assert s.reward == float(s.rollout.metadata["episode_reward"]) and 0.0 <= s.reward <= 2.0
        assert all(turn == {"env": "GuessDigit", "role": "env"} for turn in s.rollout.turns if turn["role"] == "env")
    from stream_rl.transport.client import Transport

    transport = Transport(make_config(), "test")
    beats = [b for b in read_values(transport, transport.names.status, "heartbeat") if b.role == "producer"]
    health = [b.metrics for b in beats if "env/GuessDigit/ok" in b.metrics]  # `stream-rl status` shows these
    assert health and health[-1]["env/GuessDigit/ok"] > 0 and health[-1]["env/GuessDigit/timed_out"] == 0
