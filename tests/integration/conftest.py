"""Fixtures of the integration tier: every test here may use the session's real broker (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def bus(make_config):
    """A transport on this test's run and a sink of it (closed at the end)."""
    from stream_rl.transport.client import Transport

    transport = Transport(make_config(), "test-weights")
    sink = transport.sink()
    yield transport, sink
    sink.close()
