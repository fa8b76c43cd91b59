"""``--set`` and ``STREAM_RL_*`` values that open with ``{`` or ``[`` are TOML, as in the config file (issue 40:
``--set 'data.chat_template_kwargs={enable_thinking = false}'`` was read as a YAML key ``enable_thinking = false``
and ignored, so Qwen3 kept thinking); a malformed one is refused naming the flag."""

from __future__ import annotations

import json

import pytest
from support.chat import render_chatml, save_chat_tokenizer
from typer.testing import CliRunner

from stream_rl.cli.config import load_config
from stream_rl.cli.main import app
from stream_rl.config.base import ConfigError

HI = [{"role": "user", "content": "Hi"}]


def resolved(*sets: str) -> dict:
    out = CliRunner().invoke(app, ["config", *[a for s in sets for a in ("--set", s)]])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_a_toml_inline_table_on_the_command_line_is_that_table():
    cfg = resolved("data.chat_template_kwargs={enable_thinking = false}",
                   'producer.vllm.engine_kwargs={max_num_seqs = 8, kv_cache_dtype = "auto"}')
    assert cfg["data"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert cfg["producer"]["vllm"]["engine_kwargs"] == {"max_num_seqs": 8, "kv_cache_dtype": "auto"}


def test_yaml_flow_values_and_scalars_still_read_as_before():
    cfg = resolved("data.metadata_keys=[data_source, ability]", "data.chat_template_kwargs={enable_thinking: false}",
                   "producer.max_new_tokens=12")
    assert cfg["data"]["metadata_keys"] == ["data_source", "ability"]
    assert cfg["data"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert cfg["producer"]["max_new_tokens"] == 12


def test_the_environment_reads_toml_too():
    cfg = load_config(None, env={"STREAM_RL_DATA__CHAT_TEMPLATE_KWARGS": "{enable_thinking = false}"})
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match=r"invalid STREAM_RL_DATA__CHAT_TEMPLATE_KWARGS: '\{enable_thinking = \}' "
                                          r"is not a TOML inline table"):
        load_config(None, env={"STREAM_RL_DATA__CHAT_TEMPLATE_KWARGS": "{enable_thinking = }"})


@pytest.mark.parametrize("value,kind", [("{enable_thinking = }", "inline table"), ("{mode = fast}", "inline table"),
                                        ("[1, 2", "array")])
def test_a_malformed_value_is_refused_naming_the_flag(value, kind):
    out = CliRunner().invoke(app, ["config", "--set", f"data.chat_template_kwargs={value}"])
    assert out.exit_code == 2
    assert f"invalid --set data.chat_template_kwargs: {value!r} is not a TOML {kind}" in out.output


def test_the_flag_reaches_the_chat_template(tmp_path):
    """The user-visible bug: the rendered prompt gets Qwen3's empty think block (thinking off)."""
    chat_dir = save_chat_tokenizer(tmp_path / "chat")
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": HI}) + "\n")
    out = CliRunner().invoke(app, ["prompts", "validate", str(path), "--tokenizer", str(chat_dir), "--json",
                                   "--set", "data.chat_template_kwargs={enable_thinking = false}"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["stats"]["chars"]["min"] == len(render_chatml(HI, enable_thinking=False))
