"""Prompt data that used to be accepted but wrong (issue 40, item 4), and ``prompts validate --show N`` (item 5).

Real Parquet files written with pyarrow, the real CLI through typer's CliRunner, the real chat tokenizer of
:mod:`support.chat`: a mapping that names nothing, OpenRLHF's ``prompt`` + ``label``, a reward that needs an answer
the data lacks, rows no route takes, a fall-through to the default made visible, and the rendered prompts shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.chat import render_chatml
from support.prompt_files import write_jsonl
from typer.testing import CliRunner

from stream_rl.cli.main import app

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
MATH = "DigitalLearningGmbH/MATH-lighteval"
VERL = [
    {"data_source": "openai/gsm8k", "prompt": QUESTION, "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"split": "train", "index": 0}},
    {"data_source": MATH, "prompt": [{"role": "user", "content": "Compute 3/4."}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "\\frac{3}{4}"}, "extra_info": {"split": "train", "index": 1}},
]
GSM8K_DEFAULT = 'scorer.rewards={default = [{fn = "gsm8k"}]}'


def write_parquet(path: Path, records: list) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path




def validate(path: Path, *args: str):
    return CliRunner().invoke(app, ["prompts", "validate", str(path), *args])


def test_a_misspelt_nested_answer_key_is_refused_naming_the_keys_there(tmp_path, chat_dir):
    path = write_parquet(tmp_path / "train.parquet", VERL)
    out = validate(path, "--tokenizer", str(chat_dir), "--answer-key", "reward_model.groundtruth")
    assert out.exit_code == 2, out.output
    assert ("field 'reward_model.groundtruth': --answer-key / data.answer_key: 'reward_model.groundtruth' names "
            "nothing: no row has it ('reward_model' has keys: ground_truth, style)") in out.output
    out = validate(path, "--tokenizer", str(chat_dir), "--answer-key", "reward_model.ground_truth", "--json")
    assert out.exit_code == 0 and json.loads(out.stdout)["layout"]["answer"] == "reward_model.ground_truth"


@pytest.mark.parametrize("write", [write_jsonl, write_parquet])
def test_openrlhf_prompt_and_label_read_the_label_as_the_answer(tmp_path, write):
    rows = [{"prompt": "What is 2+3?", "label": "5"}, {"prompt": "What is 7*6?", "label": "42"}]
    path = write(tmp_path / ("p.jsonl" if write is write_jsonl else "p.parquet"), rows)
    out = validate(path, "--json", "--set", GSM8K_DEFAULT)
    report = json.loads(out.stdout)
    assert out.exit_code == 0, out.output
    assert report["layout"] == {"name": "openrlhf", "prompt": "prompt", "answer": "label", "id": None,
                                "metadata": []}
    assert report["warnings"] == []  # label is read, not an unknown field


def test_a_reward_that_needs_an_answer_the_data_lacks_is_refused_naming_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2+3?", "gold": "5"}, {"prompt": "1+1?"}])
    out = validate(path, "--set", GSM8K_DEFAULT)
    assert out.exit_code == 2, out.output
    assert ("p.jsonl:1: field 'answer': 2 lines have no answer, and reward 'gsm8k' (scorer.rewards) needs one: no "
            "answer column was found (columns: gold, prompt); map it with --answer-key / data.answer_key") \
        in out.output
    # the same file, its answers mapped: valid, and a function that is not a built-in verifier needs nothing
    assert validate(path, "--set", GSM8K_DEFAULT, "--answer-key", "gold").exit_code == 2  # line 2 has none
    assert validate(path, "--set", 'scorer.reward_fn=mypkg.rewards:any').exit_code == 0


def test_rows_no_route_takes_are_refused_and_a_fall_through_is_a_warning_per_value(tmp_path, chat_dir):
    path = write_parquet(tmp_path / "train.parquet", VERL)
    routes_only = 'scorer.rewards={routes = {"openai/gsm8k" = [{fn = "gsm8k"}]}}'
    out = validate(path, "--tokenizer", str(chat_dir), "--set", routes_only)
    assert out.exit_code == 2, out.output
    assert (f"row 2: field 'data_source': no reward route for data_source='{MATH}' (scorer.rewards.by = "
            "'data_source'; routes: ['openai/gsm8k']; no default): the scorer would dead-letter every rollout of "
            "1 row") in out.output
    # the routing example issue 40 found: MATH keyed "math" with a gsm8k default; verl writes MATH-lighteval
    wrong = 'scorer.rewards={routes = {math = [{fn = "math_boxed"}]}, default = [{fn = "gsm8k"}]}'
    out = validate(path, "--tokenizer", str(chat_dir), "--set", wrong)
    assert out.exit_code == 0, out.output
    assert (f"row 2: warning: field 'data_source': data_source='{MATH}' has no reward route: scored by the default "
            "[gsm8k] (scorer.rewards.routes: ['math']) (1 row)") in out.output


def test_run_dry_run_refuses_a_file_whose_reward_needs_answers_it_lacks(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2+3?"}])
    out = CliRunner().invoke(app, ["run", "--dry-run", "--set", "run.demo_dir=none", "--set",
                                   f"run.prompts_file={path}", "--set", GSM8K_DEFAULT])
    assert out.exit_code == 2
    assert f"run.prompts_file {path} is invalid, nothing started" in out.output
    assert "1 line has no answer, and reward 'gsm8k' (scorer.rewards) needs one" in out.output


def test_show_prints_the_first_prompts_as_the_producer_tokenizes_them(tmp_path, chat_dir):
    path = write_parquet(tmp_path / "train.parquet", VERL)
    out = validate(path, "--tokenizer", str(chat_dir), "--show", "1")
    assert out.exit_code == 0, out.output
    n_tokens = len(render_chatml(QUESTION)) - 2 * len("<|im_start|>") - len("<|im_end|>") + 3
    header = (f"--- prompt 1 of 2: id row1 (row 1), data_source 'openai/gsm8k', answer '5', {n_tokens} tokens ---\n")
    assert header + render_chatml(QUESTION) in out.output  # the template's text, markers and all
    assert "prompt 2 of 2" not in out.output
    out = validate(path, "--tokenizer", str(chat_dir), "--show", "5", "--json")
    shown = json.loads(out.stdout)["shown"]
    assert [s["answer"] for s in shown] == ["5", "\\frac{3}{4}"]
    assert [s["data_source"] for s in shown] == ["openai/gsm8k", MATH]
    assert shown[1]["text"] == render_chatml(VERL[1]["prompt"]) and len(shown[1]["token_ids"]) > 0
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "1+1=", "answer": "2"}])  # a plain text prompt
    out = validate(text, "--tokenizer", str(chat_dir), "--show", "1")
    assert "--- prompt 1 of 1: id line1 (line 1), data_source None, answer '2', 4 tokens ---\n1+1=" in out.output
