"""The worked example of issue 28, on CPU: a user's instruct model and verl-layout data through `stream-rl run`.

A tiny policy whose tokenizer has a real Jinja chat template (support.chat_model), a verl-layout Parquet file
(``data_source``, ``prompt`` as chat messages, ``reward_model.ground_truth``, ``extra_info``), sampling with
``top_p``, rewards routed by data source to the built-in GSM8K verifier: messages -> template -> tokens ->
generation -> routed reward -> training steps -> `stream-rl replay` shows the rendered prompt. And the GPU recipe
(configs/gsm8k_instruct.toml) resolves with --dry-run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.chat import render_chatml
from support.chat_model import build_chat_model_dir
from support.paths import REPO_ROOT

pytestmark = pytest.mark.broker

QUESTIONS = [("What is 2+3? End with #### N.", "5", "openai/gsm8k"), ("What is 4+4? End with #### N.", "8",
              "openai/gsm8k"), ("Pick A or B: which is a vowel?", "A", "mc/letters"),
             ("Pick A or B: which comes second?", "B", "mc/letters")]
ROUTES = {"openai/gsm8k": "gsm8k", "mc/letters": "multiple_choice"}

CONFIG = """
[run]
demo_dir = "none"
epochs = 20
group_size = 4

[data]
chat_template = "auto"

[producer]
top_p = 0.9
top_k = 40
max_new_tokens = 8
prompts_per_batch = 4
max_groups_per_version = 2

[scorer.rewards]
by = "data_source"

[scorer.rewards.routes]
"openai/gsm8k" = [{fn = "gsm8k", weight = 1.0}]
"mc/letters" = [{fn = "multiple_choice", weight = 0.5}]

[trainer]
groups_per_step = 2
micro_batch_size = 8
max_lag = 2
checkpoint_every = 100
"""


def _verl_parquet(path: Path, questions=QUESTIONS) -> list[list[dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}] for q, _, _ in questions]
    table = pa.table({
        "data_source": [source for _, _, source in questions],
        "prompt": messages,
        "ability": ["math"] * len(questions),
        "reward_model": [{"style": "rule", "ground_truth": a} for _, a, _ in questions],
        "extra_info": [{"split": "train", "index": i} for i in range(len(questions))],
    })
    pq.write_table(table, path)
    return messages


def _cli(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stream_rl.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_an_instruct_model_on_verl_data_trains_with_top_p_and_routed_rewards_and_replay_shows_the_template(
        broker, tmp_path, run_name):
    model = build_chat_model_dir(tmp_path / "instruct")
    data = tmp_path / "train.parquet"
    messages = _verl_parquet(data)
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"
    common = ["-c", str(config), "--bootstrap", broker.bootstrap, "--run", run_name]
    result = _cli(["run", *common, "--max-steps", "3", "--set", f"run.prompts_file={data}",
                   "--set", f"producer.model_dir={model}", "--set", f"trainer.model_dir={model}",
                   "--set", f"run_dir={run_dir}"], tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [row for row in rows if "step" in row]
    assert [row["step"] for row in steps][-1] == 3
    sources = {key.split("/", 2)[2] for row in steps for key in row if key.startswith("accuracy/source/")}
    assert sources == set(ROUTES)  # accuracy reported per data source, over the steps
    assert all(0.0 <= row[f"accuracy/source/{s}"] <= 1.0 for row in steps for s in sources
               if f"accuracy/source/{s}" in row)

    scored = _replay("scored", common, tmp_path)
    for record in scored:  # each rollout scored by the verifier its data source routes to, with its weight
        rollout = record["value"]["rollout"]
        source = rollout["metadata"]["data_source"]
        assert set(record["value"]["reward_components"]) == {ROUTES[source]}
        assert record["value"]["reward"] in ((0.0, 1.0) if source == "openai/gsm8k" else (0.0, 0.5))

    records = _replay("rollouts", common, tmp_path)
    rendered = {render_chatml(m) for m in messages}  # the template's text, generation prompt included
    from support.chat import build_chat_tokenizer

    tokenizer = build_chat_tokenizer()
    for record in records:
        rollout = record["value"]
        assert rollout["prompt_text"] in rendered
        assert rollout["prompt_token_ids"] == tokenizer(rollout["prompt_text"], add_special_tokens=False)[
            "input_ids"]
        assert rollout["metadata"]["data_source"] in ROUTES
        assert rollout["answer"] in {a for _, a, _ in QUESTIONS}


def _replay(topic: str, common: list[str], cwd: Path) -> list[dict]:
    replay = _cli(["replay", topic, *common[2:], "--show-content", "--limit", "8"], cwd, timeout=120)
    assert replay.returncode == 0, replay.stderr[-2000:]
    records = [json.loads(line) for line in replay.stdout.splitlines() if line.startswith("{")]
    assert records, replay.stdout[-2000:]
    return records


def test_the_gpu_recipe_resolves_with_dry_run(tmp_path):
    result = _cli(["run", "-c", str(REPO_ROOT / "configs" / "gsm8k_instruct.toml"), "--dry-run"], tmp_path,
                  timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    resolved = json.loads(result.stdout)
    assert resolved["producer"]["engine"] == "vllm" and resolved["producer"]["top_p"] == 0.95
    assert resolved["data"]["chat_template"] == "auto"
    assert resolved["scorer"]["rewards"]["routes"]["openai/gsm8k"] == [{"fn": "gsm8k", "weight": 1.0}]
    assert resolved["run"]["prompts_file"].endswith("train.parquet")
    assert resolved["run"]["demo_dir"] is None


def test_the_cpu_chat_recipe_trains_a_users_instruct_model_as_shipped(broker, tmp_path, run_name):
    """configs/chat_cpu.toml, changed only where a user must (paths) and where a test must (tokens, steps, and
    epochs: the test's data set has 4 prompts, one step's worth), on the model `stream-rl demo chat-model` writes."""
    model = tmp_path / "instruct"
    made = _cli(["demo", "chat-model", str(model)], tmp_path, timeout=120)
    assert made.returncode == 0 and (model / "config.json").exists(), made.stderr[-2000:]
    again = _cli(["demo", "chat-model", str(model)], tmp_path, timeout=60)
    assert again.returncode == 2 and "already exists" in again.stderr
    data = tmp_path / "train.parquet"
    _verl_parquet(data, [(f"What is {a}+{b}? End with #### N.", str(a + b), "openai/gsm8k") for a, b in
                         ((2, 3), (4, 4), (1, 6), (3, 5))])
    run_dir = tmp_path / "run"
    result = _cli(["run", "-c", str(REPO_ROOT / "configs" / "chat_cpu.toml"), "--bootstrap", broker.bootstrap,
                   "--run", run_name, "--max-steps", "2", "--set", f"run.prompts_file={data}",
                   "--set", f"producer.model_dir={model}", "--set", f"trainer.model_dir={model}",
                   "--set", "producer.max_new_tokens=8", "--set", "run.epochs=3", "--set", f"run_dir={run_dir}"],
                  tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [row for row in rows if "step" in row]
    assert [row["step"] for row in steps][-1] == 2
    assert all(math.isfinite(row["loss/policy"]) for row in steps), steps
