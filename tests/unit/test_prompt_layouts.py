"""Datasets as users have them: plain / verl / TRL layouts detected per file, from JSON lines, Parquet with nested
columns and a ``datasets`` save_to_disk directory; explicit column mapping; metadata flattened to string tags;
every error with its line (or row) and field, never sample text."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.chat import render_chatml
from support.prompt_files import write_jsonl
from typer.testing import CliRunner

from stream_rl.cli.main import app
from stream_rl.prompts import (
    CheckOptions,
    Mapping,
    PromptFileError,
    TokenizerSource,
    chat_renderer,
    check_prompt_file,
    detect_layout,
    flatten_tags,
)

SECRET = "zebra-quartz-secret"  # sample text that must never appear in a problem
QUESTION = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+3?"}]
VERL = [
    {"data_source": "openai/gsm8k", "prompt": QUESTION, "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "5"},
     "extra_info": {"split": "train", "index": 7, "tags": ["a", "b"], "ok": True}},
    {"data_source": "lighteval/MATH", "prompt": [{"role": "user", "content": "Compute 1+1."}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"split": "test", "index": 8}},
]
VERL_TAGS = [
    {"data_source": "openai/gsm8k", "ability": "math", "extra_info.index": "7", "extra_info.ok": "true",
     "extra_info.split": "train", "extra_info.tags": '["a","b"]'},
    {"data_source": "lighteval/MATH", "ability": "math", "extra_info.index": "8", "extra_info.split": "test"},
]



def write_parquet(path: Path, records: list) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)  # nested: list<struct>, struct, struct of list
    return path


def write_hf(path: Path, records: list) -> Path:
    import datasets

    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path



def options(chat_dir: Path | None = None, **kwargs) -> CheckOptions:
    source = TokenizerSource(chat_dir)
    return CheckOptions(dedup="none", renderer=lambda: chat_renderer(source), **kwargs)


def test_layouts_are_detected_from_the_columns():
    cases = {
        ("text", "answer"): ("plain", None, "answer", None, ()),
        ("messages", "prompt_id", "metadata", "data_source"): ("plain", None, None, "prompt_id", ("data_source",)),
        ("data_source", "prompt", "ability", "reward_model", "extra_info"):
            ("verl", "prompt", "reward_model.ground_truth", None, ("data_source", "ability", "extra_info")),
        ("prompt", "solution", "answer"): ("trl", "prompt", "solution", None, ()),
        ("prompt", "answer"): ("trl", "prompt", "answer", None, ()),
        ("prompt",): ("trl", "prompt", None, None, ()),
    }
    for cols, (name, prompt, answer, id_key, metadata) in cases.items():
        layout = detect_layout(cols)
        assert (layout.name, layout.prompt_key, layout.answer_key, layout.id_key, layout.metadata_keys) == \
            (name, prompt, answer, id_key, metadata), cols
    mapped = detect_layout(["question", "gold", "uid"], Mapping(prompt_key="question", answer_key="gold",
                                                                id_key="uid", metadata_keys=()))
    assert (mapped.name, mapped.prompt_key, mapped.answer_key, mapped.id_key) == ("mapped", "question", "gold", "uid")
    with pytest.raises(PromptFileError, match=r"no prompt column.*columns: answer, question"):
        detect_layout(["question", "answer"])
    with pytest.raises(PromptFileError, match=r"--answer-key / data.answer_key: column 'gold\.x' is not in the file"):
        detect_layout(["prompt"], Mapping(answer_key="gold.x"))


def test_nested_metadata_flattens_to_sorted_dotted_string_tags():
    value = {"z": 1.5, "a": {"c": None, "b": [1, "x"]}, "s": "text", "t": False, "e": {}}
    assert flatten_tags(value, "extra_info") == {"extra_info.a.b": '[1,"x"]', "extra_info.s": "text",
                                                 "extra_info.t": "false", "extra_info.z": "1.5"}
    assert list(flatten_tags(value, "m")) == ["m.a.b", "m.s", "m.t", "m.z"]  # sorted, so deterministic
    assert flatten_tags("gsm8k", "data_source") == {"data_source": "gsm8k"}
    assert flatten_tags({"k": {"q": 2}}, "x") == {"x.k.q": "2"}


@pytest.mark.parametrize("write,unit", [(write_jsonl, "line"), (write_parquet, "row"), (write_hf, "row")])
def test_verl_records_read_the_same_from_jsonl_parquet_and_a_datasets_dir(tmp_path, chat_dir, write, unit):
    if write is write_hf:
        pytest.importorskip("datasets")  # the trl extra; skipped (not passed) without it
    path = write(tmp_path / ("p.jsonl" if write is write_jsonl else "p.parquet" if write is write_parquet
                             else "ds"), VERL)
    report = check_prompt_file(path, options(chat_dir))
    assert report.valid, report.error_summary()
    assert report.unit == unit and report.layout.name == "verl" and report.warnings == []
    assert [r.prompt_id for r in report.rows] == [f"{unit}1", f"{unit}2"]
    assert [r.answer for r in report.rows] == ["5", "2"]
    assert [r.metadata for r in report.rows] == VERL_TAGS  # struct nulls of row 2 (tags, ok) left out
    assert [r.messages for r in report.rows] == [VERL[0]["prompt"], VERL[1]["prompt"]]
    assert [r.text for r in report.rows] == [render_chatml(VERL[0]["prompt"]), render_chatml(VERL[1]["prompt"])]


def test_trl_prompts_as_text_or_messages_with_solution(tmp_path, chat_dir):
    path = write_jsonl(tmp_path / "trl.jsonl", [
        {"prompt": "What is 2+3?", "solution": "5", "id": "x"},
        {"prompt": [{"role": "user", "content": "What is 4+4?"}], "solution": 8},
    ])
    report = check_prompt_file(path, options(chat_dir))
    assert report.valid and report.layout.name == "trl"
    first, second = report.rows
    assert (first.text, first.messages, first.prompt_token_ids, first.answer) == ("What is 2+3?", None, None, "5")
    assert second.messages == [{"role": "user", "content": "What is 4+4?"}] and second.answer == "8"
    assert second.text == "<|im_start|>user\nWhat is 4+4?<|im_end|>\n<|im_start|>assistant\n"
    assert [(w.line, w.field) for w in report.warnings] == [(1, "id")]  # an unread column, as in plain files


def test_explicit_mapping_by_flags_and_by_config(tmp_path):
    path = write_jsonl(tmp_path / "own.jsonl", [
        {"question": "1+1=", "gold": {"value": 2}, "uid": 17, "src": "mine", "meta": {"a": {"b": 1}}},
    ])
    mapping = Mapping(prompt_key="question", answer_key="gold.value", id_key="uid", metadata_keys=("src", "meta"))
    (row,) = check_prompt_file(path, CheckOptions(mapping=mapping)).rows
    assert (row.prompt_id, row.text, row.answer) == ("17", "1+1=", "2")
    assert row.metadata == {"src": "mine", "meta.a.b": "1"}

    args = ["prompts", "validate", str(path), "--prompt-key", "question", "--answer-key", "gold.value",
            "--id-key", "uid", "--metadata-keys", "src,meta", "--json"]
    out = CliRunner().invoke(app, args)
    data = json.loads(out.stdout)
    assert out.exit_code == 0 and data["layout"] == {"name": "mapped", "prompt": "question", "answer": "gold.value",
                                                     "id": "uid", "metadata": ["src", "meta"]}
    config = tmp_path / "c.toml"
    config.write_text('[data]\nprompt_key = "question"\nanswer_key = "gold.value"\n')
    out = CliRunner().invoke(app, ["prompts", "validate", str(path), "--config", str(config), "--json"])
    assert out.exit_code == 0 and json.loads(out.stdout)["layout"]["answer"] == "gold.value"


def test_a_mapping_to_a_missing_column_is_refused_naming_it_and_the_file(tmp_path):
    path = write_jsonl(tmp_path / "own.jsonl", [{"question": "1+1="}])
    with pytest.raises(PromptFileError) as err:
        check_prompt_file(path, CheckOptions(mapping=Mapping(prompt_key="problem")))
    assert str(err.value).startswith(f"{path}: --prompt-key / data.prompt_key: column 'problem' is not in the file")
    out = CliRunner().invoke(app, ["prompts", "validate", str(path), "--answer-key", "reward_model.ground_truth"])
    assert out.exit_code == 2
    assert f"prompts: {path}: --answer-key / data.answer_key: column 'reward_model.ground_truth'" in out.output


def test_errors_keep_their_row_and_the_users_field_never_the_text(tmp_path, chat_dir):
    bad = [dict(VERL[0]) for _ in range(5)]
    bad[0] = {**VERL[0], "prompt": [{"role": "user", "content": SECRET}, {"role": "robot", "content": SECRET}]}
    bad[1] = {**VERL[0], "prompt": [{"role": "user", "content": "  "}]}
    bad[2] = {**VERL[0], "reward_model": {"style": "rule", "ground_truth": 2.5}}
    bad[3] = {**VERL[0], "prompt": []}
    bad[4] = {**VERL[0], "prompt": [{"role": "user", "content": [{"type": "text", "text": SECRET}]}]}
    expected = [(1, "prompt.1.role"), (2, "prompt.0.content"), (3, "reward_model.ground_truth"), (4, "prompt"),
                (5, "prompt.0.content")]
    # a Parquet column has one type: the rows whose prompt column is still a list<struct<role, content>>
    for path, n in ((write_jsonl(tmp_path / "bad.jsonl", bad), 5), (write_parquet(tmp_path / "bad.parquet",
                                                                                  bad[:2] + bad[3:4]), 3)):
        report = check_prompt_file(path, options(chat_dir))
        got = sorted((p.line, p.field) for p in report.errors)
        assert got == (expected if n == 5 else [(1, "prompt.1.role"), (2, "prompt.0.content"), (3, "prompt")])
        assert SECRET not in report.error_summary() and SECRET not in json.dumps(report.to_dict())
    text = report.error_summary()
    assert f"{path}: row 1: field 'prompt.1.role': unknown role 'robot'" in text


def test_plain_layout_keeps_its_schema_and_text_xor_messages(tmp_path, chat_dir):
    path = write_jsonl(tmp_path / "plain.jsonl", [
        {"text": "1+1=", "messages": [{"role": "user", "content": "1+1="}]},
        {"messages": [{"role": "user", "content": "hi", "name": "ann", "tool_call_id": None}], "data_source": "d"},
        {"messages": [{"role": "tool", "content": "42", "extra": "x"}]},
    ])
    report = check_prompt_file(path, options(chat_dir))
    assert {(p.line, p.field) for p in report.errors} == {(1, "text"), (3, "messages.0.extra")}
    (row,) = report.rows
    assert row.messages == [{"role": "user", "content": "hi", "name": "ann"}] and row.metadata == {"data_source": "d"}


def test_datasets_directory_errors(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}]),
                                   "test": datasets.Dataset.from_list([{"text": "b"}])})
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(PromptFileError, match=r"holds several splits; pass one of: .*dd/train"):
        check_prompt_file(tmp_path / "dd")
    assert check_prompt_file(tmp_path / "dd" / "train").rows[0].text == "a"
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(PromptFileError, match="not a Hugging Face datasets directory"):
        check_prompt_file(tmp_path / "plain_dir")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the package were not installed
    with pytest.raises(PromptFileError, match=r"needs the datasets package: pip install 'stream-rl\[data\]'"):
        check_prompt_file(tmp_path / "dd" / "train")
