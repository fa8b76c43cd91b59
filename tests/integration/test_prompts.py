"""Prompt data tools: schema errors by line, dedup, filters, stats, epochs, Parquet, and `prompts load` on a broker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.prompt_files import write_jsonl
from typer.testing import CliRunner

from producers.engines.base import Sampling
from schemas import decode
from stream_rl.cli.main import app
from stream_rl.prompts import (
    CheckOptions,
    PromptFileError,
    PromptRow,
    check_prompt_file,
    normalize_text,
    prompt_messages,
    read_prompt_file,
)
from stream_rl.prompts.clean import percentile

SECRET = "zebra-quartz-secret"  # sample text that must never appear in a report



def error_keys(report) -> set[tuple[int, str | None]]:
    return {(p.line, p.field) for p in report.errors}


def kept_ids(report) -> list[str]:
    return [row.prompt_id for row in report.rows]


def test_malformed_lines_are_rejected_with_their_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt_id": "ok-1", "text": SECRET, "answer": 7},    # 1 valid; an integer answer becomes "7"
        '{"text": "unterminated',                              # 2 bad JSON
        "   ",                                                 # 3 blank: skipped, still counted
        {"prompt_id": "p4", "answer": "1"},                    # 4 missing text
        {"text": 5},                                           # 5 text of the wrong type
        {"text": "x", "answer": [1]},                          # 6 answer of the wrong type
        {"text": "x", "metadata": ["a"]},                      # 7 metadata not a map
        {"text": "x", "metadata": {"k": 1}},                   # 8 metadata value not a string
        {"prompt_id": "has space", "text": "x"},               # 9 invalid id
        {"prompt_id": 12, "text": "x"},                        # 10 id of the wrong type
        "[1, 2]",                                              # 11 not an object
        {"text": " \t "},                                      # 12 whitespace-only text
        '{"text": "a", "text": "b"}',                          # 13 repeated key
        {"prompt_id": "x" * 201, "text": "x"},                 # 14 id too long
    ])
    report = check_prompt_file(path)
    assert not report.valid
    assert error_keys(report) == {(2, None), (4, "text"), (5, "text"), (6, "answer"), (7, "metadata"),
                                  (8, "metadata"), (9, "prompt_id"), (10, "prompt_id"), (11, None), (12, "text"),
                                  (13, "text"), (14, "prompt_id")}
    assert [r.prompt_id for r in report.rows] == ["ok-1"] and report.rows[0].answer == "7"
    assert report.stats.rows == 13 and report.stats.valid == 1  # the blank line is not a record
    summary = report.error_summary()
    assert f"{path}:2: not JSON" in summary and f"{path}:9: field 'prompt_id':" in summary
    assert "... and 2 more errors" in summary and SECRET not in summary
    assert SECRET not in json.dumps(report.to_dict())
    with pytest.raises(PromptFileError, match=rf"{path}:2: not JSON"):
        read_prompt_file(path)


def test_unknown_fields_warn_once_per_field_and_strict_makes_them_errors(tmp_path):
    path = write_jsonl(tmp_path / "p.json", [{"text": "a", "source": "x"}, {"text": "b", "source": "y", "lvl": 1}])
    report = check_prompt_file(path)
    assert report.valid and [(w.line, w.field) for w in report.warnings] == [(1, "source"), (2, "lvl")]
    assert "in 2 lines" in report.warnings[0].message
    strict = check_prompt_file(path, CheckOptions(strict=True))
    assert not strict.valid and error_keys(strict) == {(1, "source"), (2, "lvl")}


def test_normalized_text_folds_width_case_and_whitespace():
    assert normalize_text("  2+2= ") == normalize_text("2+2=") == normalize_text("２+２=") == "2+2="
    assert normalize_text("Straße\u00a0 IST\n gut") == normalize_text("STRASSE ist gut") == "strasse ist gut"
    assert normalize_text("ﬁ") == "fi"  # compatibility ligature


def test_dedup_exact_vs_normalized_vs_none(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt_id": "a", "text": "2+2="},
        {"prompt_id": "b", "text": "  2+2= "},
        {"prompt_id": "c", "text": "２+２="},
        {"prompt_id": "d", "text": "2+2="},    # same text as line 1
        {"prompt_id": "a", "text": "3+3="},    # same id as line 1
        {"prompt_id": "e", "text": "3+3="},
    ])
    exact = check_prompt_file(path, CheckOptions(dedup="exact"))
    assert kept_ids(exact) == ["a", "b", "c", "e"]
    assert [(d.line, d.reason, d.of_line) for d in exact.dropped] == [(4, "duplicate_text", 1), (5, "duplicate_id", 1)]
    assert "different text" in exact.dropped[1].detail

    normalized = check_prompt_file(path, CheckOptions(dedup="normalized"))
    assert kept_ids(normalized) == ["a", "e"]
    assert [(d.line, d.reason, d.of_line) for d in normalized.dropped] == [
        (2, "duplicate_normalized", 1), (3, "duplicate_normalized", 1), (4, "duplicate_text", 1),
        (5, "duplicate_id", 1)]
    assert normalized.stats.dropped == {"duplicate_normalized": 2, "duplicate_text": 1, "duplicate_id": 1}

    none = check_prompt_file(path, CheckOptions(dedup="none"))  # every row would be published: ids must differ
    assert error_keys(none) == {(5, "prompt_id")} and "already used at line 1" in none.errors[0].message
    write_jsonl(path, [{"prompt_id": "a", "text": "2+2="}, {"prompt_id": "d", "text": "2+2="}])
    assert kept_ids(check_prompt_file(path, CheckOptions(dedup="none"))) == ["a", "d"]


def test_filters_drop_empty_short_long_and_long_in_tokens(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt_id": "zw", "text": "\u200b\u200b"},  # no visible character
        {"prompt_id": "short", "text": "ab"},
        {"prompt_id": "fine", "text": "a b c"},
        {"prompt_id": "long", "text": "abcdefgh"},
        {"prompt_id": "words", "text": "a b c d"},
    ])
    words = lambda text: len(text.split())  # noqa: E731 - a stand-in tokenizer
    report = check_prompt_file(path, CheckOptions(min_chars=3, max_chars=7, max_tokens=3, count_tokens=words))
    assert report.valid and kept_ids(report) == ["fine"]
    assert [(d.prompt_id, d.reason) for d in report.dropped] == [
        ("zw", "empty"), ("short", "too_short"), ("long", "too_long"), ("words", "too_many_tokens")]
    assert report.stats.tokens == {"min": 3, "mean": 3.0, "p50": 3, "p95": 3, "max": 3}

    everything = check_prompt_file(path, CheckOptions(min_chars=50))
    assert not everything.valid and "every prompt was dropped" in everything.error_summary()

    def picky(text: str) -> int:
        if "d" in text:
            raise KeyError("unknown token")
        return 1

    rejected = check_prompt_file(path, CheckOptions(max_tokens=5, count_tokens=picky))
    assert error_keys(rejected) == {(4, "text"), (5, "text")}
    with pytest.raises(ValueError, match="tokenizer"):
        CheckOptions(max_tokens=5)


def test_stats_on_a_hand_case(tmp_path):
    texts = ["a", "bb", "ccc", "dddd", "x" * 100, "bb", "BB"]
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in texts] + ["{oops"])
    stats = check_prompt_file(path, CheckOptions(dedup="exact")).stats
    assert (stats.rows, stats.valid, stats.kept, stats.unique_texts, stats.unique_normalized) == (8, 7, 6, 6, 5)
    assert stats.dropped == {"duplicate_text": 1}
    # kept lengths sorted: 1 2 2 3 4 100; mean 112/6; p50 = 3rd smallest; p95 = ceil(5.7) = 6th smallest
    assert stats.chars == {"min": 1, "mean": pytest.approx(112 / 6), "p50": 2, "p95": 100, "max": 100}
    assert percentile(list(range(1, 21)), 95) == 19 and percentile([4], 50) == 4 and percentile([1, 2], 50) == 1


def test_epochs_and_shuffle_are_deterministic_with_a_seed():
    rows = [PromptRow(f"p{i}", f"{i}+1=", str(i + 1), {}) for i in range(12)]

    def order(msgs):
        return [(m.prompt_id, m.epoch) for m in msgs]

    first = prompt_messages(rows, epochs=3, group_size=4, seed=7)
    assert order(first) == order(prompt_messages(rows, epochs=3, group_size=4, seed=7))
    assert order(first) != order(prompt_messages(rows, epochs=3, group_size=4, seed=8))
    assert [m.epoch for m in first] == [0] * 12 + [1] * 12 + [2] * 12 and {m.group_size for m in first} == {4}
    epochs = [[m.prompt_id for m in first if m.epoch == e] for e in range(3)]
    assert all(sorted(ids) == sorted(r.prompt_id for r in rows) for ids in epochs)
    assert len({tuple(ids) for ids in epochs}) == 3  # each epoch has its own order
    assert epochs[1] == [m.prompt_id for m in prompt_messages(rows, 1, 4, seed=8)]  # epoch e uses seed + e
    assert [m.prompt_id for m in prompt_messages(rows, 2, 4, seed=7, shuffle=False)] == [r.prompt_id for r in rows] * 2
    for bad in ({"epochs": 0, "group_size": 4}, {"epochs": 1, "group_size": 0}):
        with pytest.raises(PromptFileError):
            prompt_messages(rows, **bad)
    with pytest.raises(PromptFileError, match=r"group_size .*between 1 and 65536.*got 1000000000"):
        prompt_messages(rows, epochs=1, group_size=10**9)  # the producer would crash on it at every restart
    assert prompt_messages(rows, epochs=1, group_size=65536)[0].group_size == 65536


def test_parquet_round_trip_and_row_numbers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt_id": "p1", "text": "1+1=", "answer": "2", "metadata": [("task", "add")], "source": "s"},
            {"prompt_id": None, "text": "2+2=", "answer": None, "metadata": None, "source": "s"},
            {"prompt_id": "p3", "text": "  1+1= ", "answer": "2", "metadata": [], "source": "s"}]
    schema = pa.schema([("prompt_id", pa.string()), ("text", pa.string()), ("answer", pa.string()),
                        ("metadata", pa.map_(pa.string(), pa.string())), ("source", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "p.parquet")
    report = check_prompt_file(tmp_path / "p.parquet", CheckOptions(dedup="normalized"))
    assert report.valid and report.format == "parquet"
    assert report.rows == [PromptRow("p1", "1+1=", "2", {"task": "add"}), PromptRow("row2", "2+2=", None, {})]
    assert [(d.line, d.reason, d.of_line) for d in report.dropped] == [(3, "duplicate_normalized", 1)]
    assert [(w.line, w.field) for w in report.warnings] == [(1, "source")]
    same = write_jsonl(tmp_path / "p.jsonl", [{k: v for k, v in r.items() if k != "metadata"} | {
        "metadata": dict(r["metadata"] or [])} for r in rows[:2]])
    assert read_prompt_file(same)[0] == read_prompt_file(tmp_path / "p.parquet")[0]

    bad = pa.table({"text": pa.array(["ok", None, "x"]), "answer": pa.array([1.5, None, None]),
                    "metadata": pa.array([{"k": "v"}, None, {"k": None}])})  # struct metadata
    pq.write_table(bad, tmp_path / "bad.parquet")
    report = check_prompt_file(tmp_path / "bad.parquet")
    assert error_keys(report) == {(1, "answer"), (2, "text")} and kept_ids(report) == ["row3"]
    assert f"{tmp_path / 'bad.parquet'}: row 2: field 'text': missing" in report.error_summary()

    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    junk = check_prompt_file(tmp_path / "junk.parquet")
    assert error_keys(junk) == {(0, None)} and "not a readable Parquet file" in junk.errors[0].message


def test_validate_cli_exit_codes_text_and_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no built demo here: validate has no tokenizer unless one is given
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "1+1="}, {"text": "1+1= "}, {"text": "2+2="}])
    runner = CliRunner()
    out = runner.invoke(app, ["prompts", "validate", str(good), "--dedup", "normalized"])
    assert out.exit_code == 0, out.output
    assert "valid" in out.output and "line 2 (line2): duplicate_normalized of line 1" in out.output
    out = runner.invoke(app, ["prompts", "validate", str(good), "--json", "--max-chars", "4"])
    data = json.loads(out.stdout)
    assert out.exit_code == 0 and data["valid"] and data["stats"]["kept"] == 2
    assert data["stats"]["dropped"] == {"too_long": 1}

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "1+1="}, "{nope", {"text": ""}])
    out = runner.invoke(app, ["prompts", "validate", str(bad), "--json"])
    assert out.exit_code == 2 and [e["line"] for e in json.loads(out.stdout)["errors"]] == [2, 3]
    out = runner.invoke(app, ["prompts", "validate", str(bad)])
    assert out.exit_code == 2 and f"{bad}:2: not JSON" in out.output and f"{bad}:3: field 'text'" in out.output

    (tmp_path / "p.csv").write_text("text\n")
    for args in ([str(tmp_path / "missing.jsonl")], [str(tmp_path / "p.csv")],
                 [str(good), "--max-tokens", "3"], [str(good), "--min-chars", "9", "--max-chars", "3"]):
        out = runner.invoke(app, ["prompts", "validate", *args])
        assert out.exit_code == 2 and out.output.startswith("prompts: "), (args, out.output)


def _published(cfg) -> dict[int, list]:
    from stream_rl.transport.client import Transport

    transport = Transport(cfg, "test")
    with transport.reader() as reader:
        return {p: [(rec.key.decode(), decode(rec.value, "prompt")) for rec in reader.read_range((topic, p), 0, None)]
                for topic, p in reader.partitions(transport.names.prompts)}


def _load_args(path: Path, cfg) -> list[str]:
    return ["prompts", "load", str(path), "--bootstrap", cfg.kafka.bootstrap_servers, "--run", cfg.topics.run,
            "--set", f"run_dir={cfg.run_dir}"]


@pytest.mark.broker
def test_load_publishes_exactly_the_checked_records(make_config, tmp_path):
    cfg = make_config()
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt_id": f"p{i}", "text": f"{i}+1=", "answer": str(i + 1), "metadata": {"task": "add"}} for i in range(5)
    ] + [{"prompt_id": "dup", "text": " 0+1= "}, {"prompt_id": "p9", "text": "x" * 30}])
    args = _load_args(path, cfg) + ["--epochs", "2", "--seed", "3", "--group-size", "4", "--dedup", "normalized",
                                    "--max-chars", "20"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    assert "published 10 prompts (5 x 2 epochs, group size 4)" in out.output
    assert "dropped: duplicate_normalized 1, too_long 1" in out.output

    expected = prompt_messages(read_prompt_file(path, CheckOptions(dedup="normalized", max_chars=20)), 2, 4, 3)
    got = _published(cfg)
    records = [msg for part in got.values() for _, msg in part]
    assert sorted((m.prompt_id, m.epoch) for m in records) == sorted((m.prompt_id, m.epoch) for m in expected)
    assert all(key == msg.prompt_id for part in got.values() for key, msg in part)
    assert all(m.group_size == 4 and m.metadata == {"task": "add"} and m.answer == str(int(m.prompt_id[1:]) + 1)
               for m in records)
    for part in got.values():  # within a partition, records arrive in the seeded publishing order
        ids = {m.prompt_id for _, m in part}
        assert [(m.prompt_id, m.epoch) for _, m in part] == [(m.prompt_id, m.epoch) for m in expected
                                                            if m.prompt_id in ids]


@pytest.mark.broker
def test_load_of_a_file_with_one_bad_line_publishes_nothing(make_config, tmp_path):
    from stream_rl.transport.client import Transport

    cfg = make_config()
    Transport(cfg, "test").ensure_topics()
    lines = [{"prompt_id": f"p{i}", "text": f"{i}+1="} for i in range(6)]
    lines[3] = {"prompt_id": "p3", "text": ["not", "a", "string"]}
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    out = CliRunner().invoke(app, _load_args(path, cfg) + ["--epochs", "3"])
    assert out.exit_code == 2, out.output
    assert "nothing published" in out.output and f"{path}:4: field 'text': expected a string" in out.output
    assert "published " not in out.output.replace("nothing published", "")
    assert all(part == [] for part in _published(cfg).values())


def test_token_filter_with_a_real_tokenizer_directory(tmp_path):
    from stream_rl.demo.tokenizer import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path / "tok")  # character level, <bos> prepended: "1+1=" is 5 tokens
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "1+1="}, {"text": "12+34="}, {"text": "1+x="}])
    args = ["prompts", "validate", str(path), "--tokenizer", str(tmp_path / "tok"), "--max-tokens", "5", "--json"]
    out = CliRunner().invoke(app, args)
    data = json.loads(out.stdout)
    assert out.exit_code == 2 and [(e["line"], e["field"]) for e in data["errors"]] == [(3, "text")]
    assert data["dropped"][0]["reason"] == "too_many_tokens" and data["dropped"][0]["line"] == 2
    assert data["stats"]["tokens"]["max"] == 5
    out = CliRunner().invoke(app, ["prompts", "validate", str(path), "--tokenizer", str(tmp_path / "none")])
    assert out.exit_code == 2 and "prompts: " in out.output


@pytest.mark.broker
def test_load_renders_messages_and_replay_shows_the_rendered_prompt_of_a_rollout(make_config, tmp_path):
    """A verl file through `prompts load` (the policy's chat template, from producer.model_dir): each record holds
    the messages, the rendered text and its ids; a real engine generates from exactly those ids, and `replay`
    shows the rollout's prompt_text as the rendered prompt (and, redacted, the prompt's roles only)."""
    from support.chat import render_chatml
    from support.chat_model import build_chat_model_dir

    from producers.engines.base import Sampling
    from producers.engines.hf import HFEngine
    from producers.step import produce_rollouts
    from stream_rl.models.loading import load_policy
    from stream_rl.transport.client import Transport

    cfg = make_config(**{"topics.partitions": {"prompts": 1, "rollouts": 1}})
    policy = build_chat_model_dir(tmp_path / "policy")
    conversation = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": SECRET}]
    path = write_jsonl(tmp_path / "verl.jsonl", [
        {"data_source": "gsm8k", "prompt": conversation, "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"index": 3}}])
    out = CliRunner().invoke(app, _load_args(path, cfg) + ["--group-size", "2", "--set",
                                                           f"producer.model_dir={policy}"])
    assert out.exit_code == 0, out.output
    assert "(verl layout)" in out.output and "1 rendered by the chat template" in out.output
    (published,) = [msg for part in _published(cfg).values() for _, msg in part]
    rendered = render_chatml(conversation)
    model, tokenizer = load_policy(policy)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert published.messages == conversation and published.text == rendered
    assert published.prompt_token_ids.tolist() == ids and published.answer == "42"
    assert published.metadata == {"data_source": "gsm8k", "ability": "math", "extra_info.index": "3"}

    result = produce_rollouts([published], HFEngine(model, tokenizer), producer_id="producer-0",
                              sampling=Sampling(1.0), max_new_tokens=3, seed=0)
    assert len(result.rollouts) == 2 and all(r.prompt_token_ids.tolist() == ids for r in result.rollouts)
    transport = Transport(cfg, "test")
    sink = transport.sink()
    for rollout in result.rollouts:
        sink.send(transport.names.rollouts, rollout, key=rollout.group_id)
    sink.flush()
    sink.close()
    flags = ["--bootstrap", cfg.kafka.bootstrap_servers, "--run", cfg.topics.run,
             "--set", f"broker.state_dir={tmp_path / 'state'}"]
    shown = CliRunner().invoke(app, ["replay", "rollouts", "--show-content", "--limit", "1", *flags])
    assert shown.exit_code == 0, shown.output
    value = json.loads(shown.stdout.splitlines()[0])["value"]
    assert value["prompt_text"] == rendered and value["prompt_token_ids"] == ids
    redacted = CliRunner().invoke(app, ["replay", "prompts", *flags])
    assert redacted.exit_code == 0 and SECRET not in redacted.output
    assert [m["role"] for m in json.loads(redacted.stdout.splitlines()[0])["value"]["messages"]] == \
        ["system", "user"]
