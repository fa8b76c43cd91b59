"""Rules the config enforces at load time (so `--dry-run` refuses them): the trainer's loss, KL and cross-section
rules, each error one line naming the fields and where their values came from; defaults that depend on another
field are resolved where `--dry-run` shows them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from consumers.trainer.config import LOSS_DEFAULTS
from stream_rl.cli.config import config_warnings, load_config
from stream_rl.cli.main import app
from stream_rl.config.base import ConfigError


def load(**overrides):
    return load_config(None, env={}, overrides={k.replace("__", "."): v for k, v in overrides.items()})


def refused(match: str, **overrides) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        load(**overrides)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    return message


def test_the_config_tables_of_loss_defaults_agree_with_the_library():
    from stream_rl.algorithms import POLICY_LOSS_DEFAULTS

    assert LOSS_DEFAULTS == POLICY_LOSS_DEFAULTS


def test_loss_defaults_follow_the_loss_kind_unless_set():
    ppo = load().trainer.loss
    assert (ppo.clip_low, ppo.clip_high, ppo.agg) == (0.2, 0.2, "token-mean")
    gspo = load(trainer__loss__kind="gspo").trainer.loss
    assert (gspo.clip_low, gspo.clip_high, gspo.agg) == (3e-4, 4e-4, "seq-mean-token-mean")
    mixed = load(trainer__loss__kind="gspo", trainer__loss__clip_high="1e-3", trainer__loss__agg="token-mean")
    assert (mixed.trainer.loss.clip_low, mixed.trainer.loss.clip_high, mixed.trainer.loss.agg) == (
        3e-4, 1e-3, "token-mean")


def test_kl_estimator_defaults_and_refusals():
    assert load().trainer.kl.kind == "k2"  # in the loss: the estimator whose gradient is that of KL(pi || ref)
    assert load(trainer__kl__placement="reward").trainer.kl.kind == "k3"
    assert load(trainer__kl__placement="reward", trainer__kl__kind="k1").trainer.kl.kind == "k1"
    assert load(trainer__kl__kind="k3").trainer.kl.kind == "k3"
    refused(r"trainer\.kl: kind='k1' with placement='loss' has zero expected gradient.*\[from flag\]",
            trainer__kl__kind="k1")
    refused(r"trainer\.kl: adaptive=true with coef=0 never moves", trainer__kl__adaptive="true")
    assert load(trainer__kl__adaptive="true", trainer__kl__coef="0.01").trainer.kl.adaptive


def test_whitening_defaults_on_for_gae_only():
    assert load(trainer__advantage="gae").trainer.whiten_advantages is True
    assert load().trainer.whiten_advantages is False
    assert load(trainer__advantage="gae", trainer__whiten_advantages="false").trainer.whiten_advantages is False


def test_trainer_temperature_is_gone_and_the_error_names_the_replacement():
    message = refused("trainer.temperature was removed", trainer__temperature="0.7")
    assert "producer.temperature" in message and "Rollout.temperature" in message


def test_elastic_placement_is_gone_and_a_file_naming_it_is_refused_saying_why(tmp_path):
    message = refused("run.placement='elastic' was removed", run__placement="elastic")
    assert "1.03x 'auto'" in message and "use 'auto'" in message and "docs/architecture.md" in message
    toml = tmp_path / "old.toml"
    toml.write_text('[run]\nplacement = "elastic"\n')
    with pytest.raises(ConfigError, match=f"run.placement.*was removed.*from file {toml}"):
        load_config(toml, env={})
    assert load(run__placement="none").run.placement == "none"
    assert load(run__trainer_ranks=2).run.placement == "auto"


def test_dr_grpo_budget_defaults_to_the_generation_budget_and_must_cover_it(tmp_path):
    assert load(producer__max_new_tokens="12").trainer.loss.max_len == 12
    ok = load(producer__max_new_tokens="12", trainer__loss__agg="seq-mean-token-sum-norm", trainer__loss__max_len="16")
    assert ok.trainer.loss.max_len == 16
    path = tmp_path / "c.toml"
    path.write_text("[producer]\nmax_new_tokens = 12\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={}, overrides={"trainer.loss.agg": "seq-mean-token-sum-norm",
                                             "trainer.loss.max_len": "8"})
    assert str(info.value) == (
        "invalid config: trainer.loss.max_len=8 < producer.max_new_tokens=12: Dr. GRPO's constant normaliser must "
        f"cover the longest response the producers may generate [trainer.loss.max_len from flag, "
        f"producer.max_new_tokens from file {path}]")


def test_producers_may_not_run_further_ahead_than_the_trainer_accepts(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  max_lag: 2\nproducer:\n  max_groups_per_version: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={"STREAM_RL_PRODUCER__VERSIONS_AHEAD": "3"})
    message = str(info.value)
    assert message.startswith("invalid config: producer.versions_ahead=3 > trainer.max_lag=2")
    assert message.endswith(f"[producer.versions_ahead from env STREAM_RL_PRODUCER__VERSIONS_AHEAD, "
                            f"trainer.max_lag from file {path}]")
    equal = load_config(path, env={"STREAM_RL_PRODUCER__VERSIONS_AHEAD": "2"})  # allowed, with a warning
    assert any("versions_ahead = trainer.max_lag = 2" in w for w in config_warnings(equal))
    assert config_warnings(load()) == []  # the defaults (1 ahead, lag 4) are quiet
    # without backpressure (max_groups_per_version unset) versions_ahead does nothing, so it is not checked
    assert load(producer__versions_ahead="9").producer.versions_ahead == 9


def test_cli_refuses_at_dry_run_and_warns_on_stderr():
    runner = CliRunner()
    bad = runner.invoke(app, ["train", "--dry-run", "--set", "producer.versions_ahead=9",
                              "--set", "producer.max_groups_per_version=8"])
    assert bad.exit_code == 2
    assert "producer.versions_ahead=9 > trainer.max_lag=4" in bad.output
    assert "producer.versions_ahead from flag, trainer.max_lag from defaults" in bad.output
    gspo = runner.invoke(app, ["train", "--dry-run", "--set", "trainer.loss.kind=gspo",
                               "--set", "trainer.loss.clip_low=0.2"])
    assert gspo.exit_code == 0
    assert "warning: trainer.loss.kind='gspo' with a PPO-range clip" in gspo.stderr
    shown = json.loads(gspo.stdout)
    assert shown["trainer"]["loss"]["clip_low"] == 0.2 and shown["trainer"]["loss"]["clip_high"] == 4e-4
    assert shown["trainer"]["loss"]["max_len"] == 32 and shown["trainer"]["kl"]["kind"] == "k2"
    quiet = runner.invoke(app, ["train", "--dry-run", "--set", "trainer.loss.kind=gspo"])
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr


def test_a_producer_batch_must_fit_a_request():
    from stream_rl.transport.settings import producer_settings

    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides={"kafka.batch_size": 2000000})
    assert str(info.value).startswith("invalid config: kafka.batch_size=2000000 > kafka.max_request_size=1048576")
    cfg = load_config(None, env={}, overrides={"kafka.batch_size": 1048576})
    assert producer_settings(cfg.kafka, "127.0.0.1:9092")["batch_size"] == 1048576
    assert producer_settings(load().kafka, "127.0.0.1:9092")["batch_size"] == 786432  # above one rollout record
    assert producer_settings(load().kafka, "127.0.0.1:9092")["compression_type"] is None  # kafka.compression none
    from stream_rl.transport.settings import consumer_settings

    assert consumer_settings(load().kafka, "127.0.0.1:9092", "g")["fetch_max_wait_ms"] == 500  # kafka-python's
    assert consumer_settings(load(kafka__fetch_max_wait_ms=100).kafka, "x:1", "g")["fetch_max_wait_ms"] == 100
    lz4 = load(kafka__compression="lz4").kafka
    assert producer_settings(lz4, "127.0.0.1:9092")["compression_type"] == "lz4"
    small = load_config(None, env={}, overrides={"kafka.max_request_size": 500000})  # the default follows the limit
    assert small.kafka.batch_size is None and producer_settings(small.kafka, "h:1")["batch_size"] == 500000
