"""Conversational prompts rendered by the chat template when they are loaded: exact text and ids from a real
tokenizer with a real Jinja template (:mod:`support.chat`), template kwargs and file override, every refusal at
validate time with its line (no template, ``none``, a template that raises, too many tokens), and the records
``prompts load`` / ``run`` publish (messages, rendered text, rendered ids)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.chat import CHARACTERS, RAISING_TEMPLATE, SPECIAL_TOKENS, render_chatml, save_chat_tokenizer
from support.prompt_files import write_jsonl
from typer.testing import CliRunner

from schemas import decode, encode, validate
from stream_rl.cli.main import app
from stream_rl.config.data import DataConfig
from stream_rl.prompts import (
    TokenizerSource,
    chat_renderer,
    check_options,
    check_prompt_file,
    prompt_messages,
    read_prompt_file,
)

SECRET = "zebra-quartz-secret"
HI = [{"role": "user", "content": "Hi"}]
ADD = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


def char_id(character: str) -> int:
    """The chat tokenizer's documented vocabulary: 4 special tokens, then one id per character."""
    return len(SPECIAL_TOKENS) + CHARACTERS.index(character)




@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory) -> Path:
    return save_chat_tokenizer(tmp_path_factory.mktemp("bare"), chat_template=None)


def test_render_gives_the_templates_text_and_its_ids_without_added_specials(chat_dir):
    text, ids = chat_renderer(TokenizerSource(chat_dir)).render(HI)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    im_start, im_end = 2, 3  # <|im_start|>, <|im_end|>
    assert ids == [im_start, *map(char_id, "user\nHi"), im_end, char_id("\n"), im_start,
                   *map(char_id, "assistant\n")]
    assert len(ids) == 21  # 3 markers + 18 characters: nothing prepended (no BOS), nothing appended


def test_a_template_that_writes_bos_gets_it_once(tmp_path):
    """The demo tokenizer prepends <bos> by default; the rendered text already holds it, so no second one."""
    from stream_rl.demo.tokenizer import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path / "demo")
    template = tmp_path / "bos.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}=")
    text, ids = chat_renderer(TokenizerSource(tmp_path / "demo"), str(template)).render(
        [{"role": "user", "content": "1+1"}])
    assert text == "<bos>1+1=" and ids == [1, 4, 13, 4, 14]  # <bos> 1 + 1 =, one <bos>


def test_template_kwargs_and_a_template_file_override(chat_dir, tmp_path):
    text, _ = chat_renderer(TokenizerSource(chat_dir), "auto", {"enable_thinking": False}).render(ADD)
    assert text == render_chatml(ADD) + "<think>\n\n</think>\n\n"
    template = tmp_path / "brackets.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}>{% endif %}")
    text, ids = chat_renderer(TokenizerSource(chat_dir), str(template)).render(ADD)
    assert text == "[system]Be brief.[user]What is 2+3?>" and ids == [char_id(c) for c in text]


def test_rendered_rows_carry_messages_text_and_ids_and_count_rendered_tokens(chat_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt_id": "a", "messages": ADD, "answer": "5"},
                                              {"prompt_id": "b", "text": "1+1="}])
    report = check_prompt_file(path, check_options(DataConfig(), tokenizer=chat_dir))
    assert report.valid, report.error_summary()
    chat, plain = report.rows
    assert chat.messages == ADD and chat.text == render_chatml(ADD)
    assert list(chat.prompt_token_ids) == chat_renderer(TokenizerSource(chat_dir)).render(ADD)[1]
    assert (plain.messages, plain.prompt_token_ids) == (None, None)  # a text prompt is tokenised by the producer
    # 3 <|im_start|> (12 characters) and 2 <|im_end|> (10 characters) are one token each
    rendered = len(render_chatml(ADD)) - 3 * (12 - 1) - 2 * (10 - 1)
    assert report.stats.tokens["max"] == rendered == len(chat.prompt_token_ids)
    assert report.stats.tokens["min"] == 4  # "1+1=" with the tokenizer's defaults: no specials added


def test_auto_without_a_template_and_none_are_refused_at_validate_naming_the_line(bare_dir, chat_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "1+1="}, {"messages": HI}, {"messages": HI}])
    report = check_prompt_file(path, check_options(DataConfig(), tokenizer=bare_dir))
    (error,) = report.errors
    assert (error.line, error.field) == (2, "messages")
    assert f"the tokenizer in {bare_dir} has no chat template" in error.message and "(2 conversational" in \
        error.message
    report = check_prompt_file(path, check_options(DataConfig(chat_template="none"), tokenizer=chat_dir))
    assert [(e.line, e.field) for e in report.errors] == [(2, "messages")]
    assert "data.chat_template is 'none'" in report.errors[0].message
    report = check_prompt_file(path, check_options(DataConfig()))  # no tokenizer anywhere
    assert "pass --tokenizer DIR or set producer.model_dir" in report.errors[0].message
    missing = tmp_path / "nope.jinja"
    report = check_prompt_file(path, check_options(DataConfig(chat_template=str(missing)), tokenizer=chat_dir))
    assert f"data.chat_template: cannot read the template file {missing}" in report.errors[0].message


def test_a_template_that_raises_is_an_error_of_its_line_naming_the_exception(tmp_path):
    raising = save_chat_tokenizer(tmp_path / "raising", chat_template=RAISING_TEMPLATE)
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"messages": HI},
        {"messages": [{"role": "user", "content": SECRET}, {"role": "tool", "content": SECRET}]},
    ])
    report = check_prompt_file(path, check_options(DataConfig(), tokenizer=raising))
    (error,) = report.errors
    assert (error.line, error.field) == (2, "messages")
    assert error.message == "the chat template raises TemplateError: tool messages are not supported"
    assert SECRET not in report.error_summary() and [r.line for r in report.rows] == [1]


def test_a_rendered_prompt_over_the_token_budget_is_dropped_naming_its_line(chat_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": HI}, {"messages": ADD}])  # 21 and 50 tokens
    for options in (check_options(DataConfig(max_prompt_tokens=21), tokenizer=chat_dir),
                    check_options(DataConfig(), tokenizer=chat_dir, max_tokens=21),
                    check_options(DataConfig(max_prompt_tokens=21), policy_dir=chat_dir)):
        report = check_prompt_file(path, options)
        (dropped,) = report.dropped
        assert (dropped.line, dropped.reason, dropped.detail) == (2, "too_many_tokens", "50 tokens > max_tokens 21")
        assert [r.line for r in report.rows] == [1]


def test_published_records_hold_messages_rendered_text_and_ids(chat_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt_id": "a", "messages": ADD, "answer": "5"},
                                              {"prompt_id": "b", "text": "1+1="}])
    rows = read_prompt_file(path, check_options(DataConfig(), policy_dir=chat_dir))
    records = prompt_messages(rows, epochs=2, group_size=4, seed=0)
    assert len(records) == 4
    for record in records:
        validate(record)
        again = decode(encode(record), "prompt")  # what a producer reads from the topic
        if record.prompt_id == "a":
            assert again.messages == ADD and again.text == render_chatml(ADD)
            assert again.prompt_token_ids.dtype == np.int32
            assert again.prompt_token_ids.tolist() == list(rows[0].prompt_token_ids)
        else:
            assert (again.messages, again.prompt_token_ids, again.text) == (None, None, "1+1=")


def test_validate_cli_renders_with_the_policy_tokenizer_and_reports_rendered_lengths(chat_dir, bare_dir, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": HI}, {"messages": ADD}])
    runner = CliRunner()
    out = runner.invoke(app, ["prompts", "validate", str(path), "--tokenizer", str(chat_dir), "--json"])
    data = json.loads(out.stdout)
    assert out.exit_code == 0 and data["layout"]["name"] == "plain"
    assert (data["stats"]["tokens"]["min"], data["stats"]["tokens"]["max"]) == (21, 50)
    config = tmp_path / "c.toml"
    config.write_text(f'[producer]\nmodel_dir = "{chat_dir}"\n[data]\nchat_template_kwargs = {{enable_thinking = '
                      'false}\n')
    out = runner.invoke(app, ["prompts", "validate", str(path), "--config", str(config), "--json"])
    data = json.loads(out.stdout)
    assert out.exit_code == 0 and data["stats"]["chars"]["min"] == len(render_chatml(HI, enable_thinking=False))
    out = runner.invoke(app, ["prompts", "validate", str(path), "--tokenizer", str(chat_dir)])
    assert out.exit_code == 0 and f"{path} (jsonl, layout plain): valid" in out.output
    assert "rendered by the chat template: 2 conversational prompts (kept)" in out.output
    assert "tokens (kept): min 21, mean 35.5, p50 21, p95 50, max 50" in out.output
    out = runner.invoke(app, ["prompts", "validate", str(path), "--set", f"producer.model_dir={bare_dir}"])
    assert out.exit_code == 2 and f"{path}:1: field 'messages': the tokenizer in {bare_dir} has no chat " \
        "template" in out.output
