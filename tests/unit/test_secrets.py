"""Secrets are never printed: every ``SecretStr`` field, through every command that prints the config (`config`
and each ``--dry-run``), the run's ``config.yaml`` and config errors; secret files are shown by path only."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from stream_rl.cli.config import StreamRLConfig, load_config
from stream_rl.cli.main import app
from stream_rl.config.loading import secret_fields
from stream_rl.config.sections import read_secret

MASK = "**********"
DRY_RUN_COMMANDS = [["config"], ["train", "--dry-run"], ["produce", "--dry-run"], ["score", "--dry-run"],
                    ["run", "--dry-run"], ["topics", "create", "--dry-run"], ["broker", "up", "--dry-run"]]


def _env_name(dotted: str) -> str:
    return "STREAM_RL_" + dotted.upper().replace(".", "__")


@pytest.fixture
def secret_env(monkeypatch) -> dict[str, str]:
    """A distinct sentinel in every SecretStr field of the config, set through the environment."""
    fields = secret_fields(StreamRLConfig)
    assert "kafka.sasl_password" in fields
    values = {name: f"sentinel-{i}-do-not-print" for i, name in enumerate(sorted(fields))}
    for name, value in values.items():
        monkeypatch.setenv(_env_name(name), value)
    return values


@pytest.mark.parametrize("args", DRY_RUN_COMMANDS, ids=lambda a: " ".join(a))
def test_printed_config_masks_every_secret(args, secret_env, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAM_RL_RUN__DEMO_DIR", str(tmp_path / "no-demo"))  # `run --dry-run` builds nothing
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for value in secret_env.values():
        assert value not in result.output
    assert result.output.count(MASK) >= len(secret_env)


def test_secret_file_is_shown_by_path_not_content(tmp_path, monkeypatch):
    secret = tmp_path / "sasl.pw"
    secret.write_text("file-sentinel-do-not-print\n")
    monkeypatch.setenv("STREAM_RL_KAFKA__SASL_PASSWORD_FILE", str(secret))
    result = CliRunner().invoke(app, ["config"])
    assert result.exit_code == 0, result.output
    assert str(secret) in result.output and "file-sentinel" not in result.output
    cfg = load_config(None, env={"STREAM_RL_KAFKA__SASL_PASSWORD_FILE": str(secret)})
    assert read_secret(cfg.kafka.sasl_password, cfg.kafka.sasl_password_file) == "file-sentinel-do-not-print"


def test_run_config_file_and_errors_leave_secrets_out(secret_env, tmp_path):
    from stream_rl.launch.orchestrator import write_run_config

    cfg = load_config(None)
    text = write_run_config(cfg, tmp_path).read_text()
    assert all(value not in text for value in secret_env.values())
    assert "sasl_password" not in yaml.safe_load(text)["kafka"]
    bad = CliRunner().invoke(app, ["config", "--set", "kafka.linger_ms=-1"])
    assert bad.exit_code == 2 and "kafka.linger_ms" in bad.output
    assert all(value not in bad.output for value in secret_env.values())


@pytest.mark.parametrize("password", ["123456", "true", "null", "a: b", "[x", "  spaced "])
def test_secret_values_are_taken_verbatim(password):
    """Environment values are YAML scalars, except secrets: a numeric password stays text, "null" is not None."""
    cfg = load_config(None, env={"STREAM_RL_KAFKA__SASL_PASSWORD": password})
    assert cfg.kafka.sasl_password.get_secret_value() == password
    flagged = load_config(None, env={}, overrides={"kafka.sasl_password": password})
    assert flagged.kafka.sasl_password.get_secret_value() == password
    assert load_config(None, env={"STREAM_RL_KAFKA__LINGER_MS": "7"}).kafka.linger_ms == 7  # others still parse
