"""Fixtures of the integration tier: every test here may use the session's real broker (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A tiny policy saved with the demo tokenizer, as a model directory the roles load."""
    from support.trainer import tiny_policy

    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models import save_model

    return save_model(tiny_policy(seed=0), build_tokenizer(), tmp_path / "policy")


@pytest.fixture
def bus(make_config):
    """A transport on this test's run and a sink of it (closed at the end)."""
    from stream_rl.transport.client import Transport

    transport = Transport(make_config(), "test-weights")
    sink = transport.sink()
    yield transport, sink
    sink.close()
