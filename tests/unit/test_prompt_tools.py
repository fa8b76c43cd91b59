"""Tool-use prompts (issue 40): assistant turns with OpenAI-format ``tool_calls`` and a per-prompt ``tools`` column
are accepted and rendered exactly as ``transformers``' ``apply_chat_template(messages, tools=tools)`` renders them
(text and ids), from JSON lines and from a Parquet file written with pyarrow; a template that never reads them is
refused with the reason; malformed calls name their field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.chat import CHATML_TEMPLATE, TOOLS_TEMPLATE, build_chat_tokenizer, save_chat_tokenizer
from typer.testing import CliRunner

from schemas import validate
from stream_rl.cli.main import app
from stream_rl.prompts import CheckOptions, TokenizerSource, chat_renderer, check_prompt_file, prompt_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current temperature of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = {"role": "user", "content": "How warm is Paris?"}
REPLY = {"role": "tool", "tool_call_id": "c1", "content": "21 C"}
# as transformers documents tool calls: arguments an object; the file may carry OpenAI's JSON string instead
CALL = {"role": "assistant", "tool_calls": [{"type": "function", "id": "c1",
                                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
EXPECTED = [{"role": "system", "content": "Use the tools."}, ASK, CALL, REPLY]


def openai_form(message: dict) -> dict:
    """The same message as an OpenAI dataset stores it: content null, arguments a JSON string."""
    if "tool_calls" not in message:
        return message
    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])
                                if isinstance(c["function"]["arguments"], dict) else c["function"]["arguments"]}}
             for c in message["tool_calls"]]
    return {**message, "content": None, "tool_calls": calls}


def as_json(tools: object) -> str | None:
    """A tools value as a Parquet file holds it: one JSON string (or null)."""
    return tools if tools is None or isinstance(tools, str) else json.dumps(tools)


def write_parquet(path: Path, records: list) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory) -> Path:
    return save_chat_tokenizer(tmp_path_factory.mktemp("tools"), chat_template=TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> Path:
    return save_chat_tokenizer(tmp_path_factory.mktemp("chatml"), chat_template=CHATML_TEMPLATE)


def check(path: Path, tokenizer_dir: Path):
    source = TokenizerSource(tokenizer_dir)
    return check_prompt_file(path, CheckOptions(dedup="none", renderer=lambda: chat_renderer(source)))


def reference(messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]:
    tokenizer = build_chat_tokenizer(TOOLS_TEMPLATE)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    return text, list(ids)


def test_jsonl_and_parquet_render_exactly_as_apply_chat_template_with_tools(tmp_path, tools_dir):
    records = [{"messages": EXPECTED, "tools": [WEATHER], "answer": "21"},  # objects, as transformers takes them
               {"messages": [openai_form(m) for m in EXPECTED], "tools": json.dumps([WEATHER])},  # OpenAI's form
               {"messages": [ASK], "tools": json.dumps([WEATHER])},
               {"messages": [ASK]}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    parquet = write_parquet(tmp_path / "p.parquet", [{**r, "messages": [openai_form(m) for m in r["messages"]],
                                                      "tools": as_json(r.get("tools"))}
                                                     for r in records])
    expected = [reference(EXPECTED, [WEATHER]), reference(EXPECTED, [WEATHER]), reference([ASK], [WEATHER]),
                reference([ASK], None)]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in expected[0][0]
    assert '"name": "get_weather"' in expected[2][0] and "<tools>" not in expected[3][0]
    for path in (jsonl, parquet):
        report = check(path, tools_dir)
        assert report.valid, report.error_summary()
        assert [(r.text, list(r.prompt_token_ids)) for r in report.rows] == expected, path
        assert report.warnings == []  # tools is a known column


def test_a_template_that_never_reads_tools_or_tool_calls_is_refused_with_the_reason(tmp_path, chatml_dir):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [ASK], "tools": [WEATHER]}) + "\n" + json.dumps({"messages": EXPECTED})
                    + "\n")
    report = check(path, chatml_dir)
    assert [(p.line, p.message) for p in report.errors] == [
        (1, "the row has tools and the chat template never reads `tools`: they would be left out of the prompt; use "
            "a template that supports tools (data.chat_template = a Jinja file)"),
        (2, "an assistant message has tool_calls and the chat template never reads `tool_calls`: they would be left "
            "out of the prompt; use a template that supports tools")]


def test_malformed_tool_calls_and_tools_name_their_field(tmp_path, tools_dir):
    bad_args = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                      "arguments": "{city: x"}}]}
    rows = [{"messages": [ASK, bad_args]},
            {"messages": [{**ASK, "tool_calls": CALL["tool_calls"]}]},
            {"messages": [ASK, {"role": "assistant", "tool_calls": [{"name": "f"}]}]},
            {"text": "plain", "tools": [WEATHER]},
            {"messages": [ASK], "tools": "[{]"},
            {"messages": [ASK], "tools": [{"type": "function"}]}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = {(p.line, p.field) for p in check(path, tools_dir).errors}
    assert found == {(1, "messages.1.tool_calls.0.function.arguments"), (2, "messages.0.tool_calls"),
                     (3, "messages.1.tool_calls.0.function"), (4, "tools"), (5, "tools"), (6, "tools.0")}


def test_published_records_carry_the_calls_as_json_and_validate(tmp_path, tools_dir):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": EXPECTED, "tools": [WEATHER]}) + "\n")
    (record,) = prompt_messages(check(path, tools_dir).rows, epochs=1, group_size=2)
    validate(record)
    assert json.loads(record.messages[2]["tool_calls"]) == CALL["tool_calls"]
    assert record.text == reference(EXPECTED, [WEATHER])[0]


def test_validate_cli_accepts_and_shows_a_tool_use_prompt(tmp_path, tools_dir):
    path = write_parquet(tmp_path / "p.parquet", [{"messages": [openai_form(m) for m in EXPECTED],
                                                   "tools": json.dumps([WEATHER]), "answer": "21"}])
    out = CliRunner().invoke(app, ["prompts", "validate", str(path), "--tokenizer", str(tools_dir), "--show", "1"])
    assert out.exit_code == 0, out.output
    assert reference(EXPECTED, [WEATHER])[0] in out.output


def test_a_tool_call_history_renders_on_the_real_deepseek_template_from_either_form(tmp_path):
    """DeepSeek-R1-Distill's template (verbatim) writes an assistant turn's calls only when its content is null and
    concatenates the arguments as text: a call row in transformers' form (content left out, arguments an object)
    and in OpenAI's (content null, arguments a JSON string) both render the call (before: the template raised)."""
    from support.chat import build_template_tokenizer

    tokenizer = build_template_tokenizer("deepseek-r1-distill")
    tokenizer.save_pretrained(tmp_path / "deepseek")
    rows = [{"messages": [ASK, CALL, REPLY]}, {"messages": [ASK, openai_form(CALL), REPLY]}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = check(path, tmp_path / "deepseek")
    assert report.valid, report.error_summary()
    bar, space = "\uff5c", "\u2581"
    call = (f"<{bar}Assistant{bar}><{bar}tool{space}calls{space}begin{bar}><{bar}tool{space}call{space}begin{bar}>"
            f'function<{bar}tool{space}sep{bar}>get_weather\n```json\n{{"city": "Paris"}}\n```'
            f"<{bar}tool{space}call{space}end{bar}>")
    assert [call in r.text for r in report.rows] == [True, True]
    assert report.rows[0].text == report.rows[1].text
