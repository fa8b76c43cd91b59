"""Topic retention from the config: retention keys, per-topic configs, defaults for every logical topic and
invalid values."""

from __future__ import annotations

import pytest

from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError
from stream_rl.config.sections import DEFAULT_RETENTION_MS
from stream_rl.transport.topics import LOGICAL_TOPICS, TopicNames, retention_key, topic_configs


def test_retention_key_maps_chunk_topics_and_foreign_names():
    names = TopicNames("stream-rl", "r1")
    assert retention_key(names, "stream-rl.r1.scored") == "scored"
    assert retention_key(names, "stream-rl.r1.weights") == "weights"
    assert retention_key(names, "stream-rl.r1.weights.v00012") == "weights_chunks"
    assert retention_key(names, "stream-rl.r1.weights.vx") == "weights.vx"
    assert retention_key(names, "stream-rl.other.scored") is None


def test_topic_configs_from_config():
    cfg = load_config(None, env={}, overrides={"topics.run": "r1", "topics.retention_ms": {"status": 5000}})
    assert topic_configs(cfg.topics, "stream-rl.r1.status") == {"retention.ms": "5000"}
    assert topic_configs(cfg.topics, "stream-rl.r1.scored") == {}  # not listed: broker default
    default = load_config(None, env={}, overrides={"topics.run": "r1"})
    assert topic_configs(default.topics, "stream-rl.r1.weights.v3") == {"retention.ms": str(86_400_000)}
    assert topic_configs(default.topics, "stream-rl.r1.prompts") == {"retention.ms": "-1"}


def test_every_logical_topic_has_a_default_retention():
    assert set(DEFAULT_RETENTION_MS) == set(LOGICAL_TOPICS) | {"weights_chunks"}
    assert DEFAULT_RETENTION_MS["status"] == 24 * 3600 * 1000
    assert DEFAULT_RETENTION_MS["alerts"] == 30 * 24 * 3600 * 1000


@pytest.mark.parametrize("bad", [0, -2])
def test_invalid_retention_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"topics.retention_ms.*must be -1"):
        load_config(None, env={"STREAM_RL_TOPICS__RETENTION_MS": f"{{status: {bad}}}"})
