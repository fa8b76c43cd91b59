"""``stream-rl evaluate --model DIR`` evaluates one policy once with no broker and prints its metrics; the refusals
exit 2 with one line naming what is wrong."""

from __future__ import annotations

import json

import pytest
from support.evaluation import write_prompts
from support.producers import build_tiny_model_dir
from typer.testing import CliRunner

from stream_rl.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def _sets(path) -> list[str]:
    return ["--set", f"eval.sets={{\"heldout\": \"{path}\"}}", "--set", "eval.n=2", "--set", "eval.k=[1, 2]",
            "--set", "eval.max_new_tokens=4", "--set", "eval.reward_fn=support.evaluation:even_length",
            "--set", "run.demo_dir=null"]


def test_evaluate_model_once_prints_the_metrics_of_that_policy(model_dir, tmp_path):
    from producers.engines.hf import HFEngine
    from evaluator.role import evaluate_once
    from stream_rl.cli.config import load_config

    prompts = write_prompts(tmp_path / "heldout.jsonl", count=3)
    result = runner.invoke(app, ["evaluate", "--model", str(model_dir), *_sets(prompts)])
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["model"] == str(model_dir) and line["version"] == 0
    cfg = load_config(None, env={}, overrides={"eval": {"sets": {"heldout": str(prompts)}, "n": 2, "k": [1, 2],
                                                        "max_new_tokens": 4,
                                                        "reward_fn": "support.evaluation:even_length"}})
    # the same policy, in process
    want = evaluate_once(cfg, cfg.eval, cfg.producer, engine=HFEngine.from_dir(model_dir)).metrics
    assert line["metrics"] == pytest.approx(want)
    assert line["metrics"]["heldout/prompts"] == 3.0


def test_refusals_exit_2_naming_the_problem(model_dir, tmp_path):
    prompts = write_prompts(tmp_path / "heldout.jsonl", count=2)
    no_eval = runner.invoke(app, ["evaluate", "--model", str(model_dir), "--set", "run.demo_dir=null"])
    assert no_eval.exit_code == 2 and "[eval]" in no_eval.output
    both = runner.invoke(app, ["evaluate", "--model", str(model_dir), "--checkpoint", str(tmp_path), *_sets(prompts)])
    assert both.exit_code == 2 and "exclude each other" in both.output
    k_above_n = runner.invoke(app, ["evaluate", "--model", str(model_dir), *_sets(prompts), "--set", "eval.k=[3]"])
    assert k_above_n.exit_code == 2 and "eval.k" in k_above_n.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_id": 3}\n')
    invalid = runner.invoke(app, ["evaluate", "--model", str(model_dir), *_sets(bad)])
    assert invalid.exit_code == 2 and "bad.jsonl" in invalid.output


def test_instance_names_the_evaluator_as_stream_rl_run_starts_it(model_dir, tmp_path):
    prompts = write_prompts(tmp_path / "heldout.jsonl", count=2)
    shown = runner.invoke(app, ["evaluate", "--instance", "3", "--dry-run", *_sets(prompts)])
    assert shown.exit_code == 0, shown.output
    assert '"evaluator_id": "evaluator-3"' in shown.stdout
