"""Shared fixtures: one real local broker per test session, unique run names, offline Hugging Face."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _role_logging_does_not_leak():
    """A role command run in-process (CliRunner) sets up role logging on the root logger; undo it after the test,
    so later tests' captured output holds only what their own command printed."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    """A real tansu broker on 127.0.0.1, started for the session and stopped (that PID only) at the end.

    Memory storage, for speed: the tests that need a broker to survive a kill -9 start their own durable one."""
    from stream_rl import broker as broker_mod
    from stream_rl.config.sections import BrokerConfig

    cfg = BrokerConfig(state_dir=tmp_path_factory.mktemp("broker"), storage="memory")
    state = broker_mod.up(cfg)
    yield state
    broker_mod.down(cfg)


@pytest.fixture
def durable_broker(tmp_path):
    """A broker of this test's own with durable storage (the tests that kill it), stopped at the end."""
    from stream_rl import broker as broker_mod
    from stream_rl.config.sections import BrokerConfig

    cfg = BrokerConfig(state_dir=tmp_path / "durable-broker", storage="durable")
    broker_mod.up(cfg)
    yield cfg
    broker_mod.down(cfg)


@pytest.fixture
def run_name() -> str:
    """A unique run name, so every test has its own topics on the shared broker."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A tiny policy saved with the demo tokenizer, as a model directory the roles load."""
    from support.trainer import tiny_policy

    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models import save_model

    return save_model(tiny_policy(seed=0), build_tokenizer(), tmp_path / "policy")


@pytest.fixture
def make_config(broker, tmp_path: Path, run_name: str):
    """Build a StreamRLConfig pointing at the session broker, with this test's run name and run dir."""
    from stream_rl.cli.config import load_config

    def _make(**overrides):
        base = {"kafka.bootstrap_servers": broker.bootstrap, "topics.run": run_name,
                "run_dir": str(tmp_path / "run")}
        base.update(overrides)
        return load_config(None, env={}, overrides=base)

    return _make


@pytest.fixture(scope="session")
def demo_build(tmp_path_factory):
    """The real built-in demo (`init_demo`: tokenizer, warm-started policy, reference, reward model, prompts),
    built once per session (about 90 s on one core) and shared read-only by the tests that need it."""
    import torch

    from stream_rl.demo.init import init_demo

    threads = torch.get_num_threads()
    root = tmp_path_factory.mktemp("demo-build") / "demo"
    info = init_demo(root, seed=0, num_threads=1)
    torch.set_num_threads(threads)
    return root, info
