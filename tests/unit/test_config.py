"""Config resolution: defaults < file < environment < flags; one-line errors naming the field; secrets masked."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from stream_rl.cli.config import StreamRLConfig, load_config
from stream_rl.cli.main import app
from stream_rl.config.base import ConfigError
from stream_rl.config.loading import dump_config


def test_defaults_are_valid():
    cfg = load_config(None, env={})
    assert cfg == StreamRLConfig()
    assert cfg.kafka.max_request_size == 1_048_576
    assert cfg.topics.partitions["rollouts"] == 4


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_precedence_file_env_flag(tmp_path, suffix):
    path = tmp_path / f"c{suffix}"
    if suffix == ".toml":
        path.write_text('[kafka]\nclient_id = "from-file"\nlinger_ms = 7\nmax_poll_records = 11\n'
                        '[topics]\nrun = "filerun"\n')
    else:
        path.write_text("kafka:\n  client_id: from-file\n  linger_ms: 7\n  max_poll_records: 11\n"
                        "topics:\n  run: filerun\n")
    env = {"STREAM_RL_KAFKA__LINGER_MS": "8", "STREAM_RL_KAFKA__MAX_POLL_RECORDS": "12"}
    cfg = load_config(path, env=env, overrides={"kafka.max_poll_records": "13"})
    assert cfg.kafka.client_id == "from-file"      # file only
    assert cfg.topics.run == "filerun"             # file only
    assert cfg.kafka.linger_ms == 8                # env beats file
    assert cfg.kafka.max_poll_records == 13        # flag beats env and file


def test_config_file_from_environment(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('run_dir = "elsewhere"\n')
    assert str(load_config(None, env={"STREAM_RL_CONFIG": str(path)}).run_dir) == "elsewhere"


@pytest.mark.parametrize("env,field", [
    ({"STREAM_RL_KAFKA__SESSION_TIMEOUT_MS": "-5"}, "kafka.session_timeout_ms"),
    ({"STREAM_RL_KAFKA__NO_SUCH_FIELD": "1"}, "kafka.no_such_field"),
    ({"STREAM_RL_TOPICS__RUN": "bad name!"}, "topics.run"),
    ({"STREAM_RL_KAFKA__SECURITY_PROTOCOL": "TLS"}, "kafka.security_protocol"),
])
def test_invalid_value_names_field_and_source(env, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, env=env)
    message = str(info.value)
    assert "\n" not in message
    assert field in message
    assert "env STREAM_RL_" in message


def test_a_section_check_names_the_source_of_the_keys_under_it(tmp_path):
    """A model validator fails at its section (``alerts.memory_growth``), not at a key: the message still says
    where the offending keys came from, without pydantic's "Value error," prefix."""
    overrides = {"alerts.memory_growth.window_s": 60, "alerts.memory_growth.min_span_s": 120}
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=overrides)
    assert str(info.value).startswith("invalid config: alerts.memory_growth: ") and "Value error" not in str(info.value)
    assert str(info.value).endswith("[from flag]")
    with pytest.raises(ConfigError, match=r"\[from env STREAM_RL_ALERTS__CONSUMER_LAG__ACTION\]$"):
        load_config(None, env={"STREAM_RL_ALERTS__CONSUMER_LAG__ACTION": "pause"})
    path = tmp_path / "c.toml"
    path.write_text("[alerts.trainer_stalled]\naction = \"pause\"\n")
    with pytest.raises(ConfigError, match=rf"\[from file {path}\]$"):
        load_config(path, env={})


def test_partition_counts_must_be_positive():
    with pytest.raises(ConfigError, match="topics.partitions"):
        load_config(None, env={}, overrides={"topics.partitions": {"rollouts": 0}})


def test_secret_masked_in_dump_and_readable_from_file(tmp_path):
    from stream_rl.transport.settings import security_settings

    secret_file = tmp_path / "pw"
    secret_file.write_text("s3cr3t-from-file\n")
    cfg = load_config(None, env={"STREAM_RL_KAFKA__SASL_PASSWORD": "hunter2-env",
                                 "STREAM_RL_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
                                 "STREAM_RL_KAFKA__SASL_USERNAME": "svc"})
    dumped = dump_config(cfg)
    assert "hunter2-env" not in dumped and "**********" in dumped
    assert security_settings(cfg.kafka)["sasl_plain_password"] == "hunter2-env"
    cfg2 = cfg.model_copy(update={"kafka": cfg.kafka.model_copy(update={"sasl_password_file": secret_file})})
    assert security_settings(cfg2.kafka)["sasl_plain_password"] == "s3cr3t-from-file"


def test_cli_dry_run_precedence_and_exit_code(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("topics:\n  run: filerun\nkafka:\n  linger_ms: 1\n")
    monkeypatch.setenv("STREAM_RL_KAFKA__LINGER_MS", "2")
    monkeypatch.setenv("STREAM_RL_KAFKA__SASL_PASSWORD", "do-not-print")
    runner = CliRunner()
    result = runner.invoke(app, ["config", "-c", str(path), "--set", "kafka.client_id=flagged", "--run", "flagrun"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["topics"]["run"] == "flagrun"
    assert shown["kafka"]["linger_ms"] == 2
    assert shown["kafka"]["client_id"] == "flagged"
    assert "do-not-print" not in result.output

    bad = runner.invoke(app, ["config", "--set", "kafka.linger_ms=-1"])
    assert bad.exit_code == 2
    assert "kafka.linger_ms" in bad.output and "[from flag]" in bad.output
    assert len(bad.output.strip().splitlines()) == 1


def test_every_error_is_listed_each_naming_its_field_and_source(monkeypatch):
    """Issue 13: a config with several errors shows all of them, not the first one and "(+2 more)"."""
    monkeypatch.setenv("STREAM_RL_TRAINER__LR", "-1")
    result = CliRunner().invoke(app, ["config", "--set", "kafka.acks=2", "--set", "kafka.linger_ms=-1"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines[0] == "invalid config (3 errors):" and "more)" not in result.output
    assert sorted(line.split(":")[0].strip() for line in lines[1:]) == ["kafka.acks", "kafka.linger_ms",
                                                                         "trainer.lr"]
    assert "[from env STREAM_RL_TRAINER__LR]" in result.output and result.output.count("[from flag]") == 2


@pytest.mark.parametrize("key,field,suggestion", [
    ("kafka.bootstrap_server", "kafka.bootstrap_server", "kafka.bootstrap_servers"),
    ("kafak.linger_ms", "kafak", "kafka"),  # a misspelt section is the unknown field
    ("trainer.max_step", "trainer.max_step", "trainer.max_steps"),
])
def test_a_misspelt_field_suggests_the_nearest_valid_name(key, field, suggestion):
    result = CliRunner().invoke(app, ["config", "--set", f"{key}=1"])
    assert result.exit_code == 2
    assert result.output.strip() == f"invalid config: {field}: unknown field [from flag]; did you mean {suggestion}?"


def test_a_stray_environment_variable_is_named_with_the_variable_to_use(monkeypatch):
    """A typo'd STREAM_RL_* variable is an error naming it and the nearest field's variable, never ignored."""
    monkeypatch.setenv("STREAM_RL_KAFKA_BOOTSTRAP_SERVERS", "host:9092")  # one underscore: not a field
    result = CliRunner().invoke(app, ["config"])
    assert result.exit_code == 2
    assert result.output.strip() == (
        "invalid config: kafka_bootstrap_servers: unknown field [from env STREAM_RL_KAFKA_BOOTSTRAP_SERVERS]; "
        "did you mean STREAM_RL_KAFKA__BOOTSTRAP_SERVERS (kafka.bootstrap_servers)?")
    monkeypatch.delenv("STREAM_RL_KAFKA_BOOTSTRAP_SERVERS")
    monkeypatch.setenv("STREAM_RL_ZZZ", "1")  # nothing near it
    result = CliRunner().invoke(app, ["config"])
    assert result.exit_code == 2 and "STREAM_RL_ZZZ" in result.output and "unset this variable" in result.output


def test_stream_rl_debug_is_the_cli_switch_not_a_field(monkeypatch):
    monkeypatch.setenv("STREAM_RL_DEBUG", "1")
    result = CliRunner().invoke(app, ["config"])
    assert result.exit_code == 0, result.output
    assert "debug" not in json.loads(result.output)


def test_setting_one_key_of_a_map_merges_into_it(tmp_path, monkeypatch):
    """Issue 13: `--set topics.partitions.rollouts=8` kept only that key (every other topic fell back to 1
    partition); a flag or variable that sets one key merges into the map, the file's or else the default."""
    monkeypatch.setenv("STREAM_RL_TOPICS__RETENTION_MS__DLQ", "5000")
    result = CliRunner().invoke(app, ["config", "--set", "topics.partitions.rollouts=8"])
    assert result.exit_code == 0, result.output
    topics = json.loads(result.output)["topics"]
    defaults = StreamRLConfig().topics
    assert topics["partitions"] == {**defaults.partitions, "rollouts": 8}
    assert topics["retention_ms"] == {**defaults.retention_ms, "dlq": 5000}
    path = tmp_path / "c.toml"
    path.write_text("[topics.partitions]\nprompts = 2\nrollouts = 2\n")  # a file's map is taken as written
    cfg = load_config(path, env={}, overrides={"topics.partitions.scored": "3"})
    assert cfg.topics.partitions == {"prompts": 2, "rollouts": 2, "scored": 3}
    whole = load_config(None, env={}, overrides={"topics.partitions": {"rollouts": 2}})  # the whole map: replaced
    assert whole.topics.partitions == {"rollouts": 2}


def test_an_item_of_a_list_names_the_source_of_its_key():
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"STREAM_RL_TELEMETRY__EXPORTERS": "[jsonl, foo]"})
    assert str(info.value).startswith("invalid config: telemetry.exporters.1: ")
    assert str(info.value).endswith("[from env STREAM_RL_TELEMETRY__EXPORTERS]")
