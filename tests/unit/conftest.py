"""The unit tier runs without a broker and without starting a process: a unit test that asks for the broker (or a
fixture built on it) fails at once, naming the tier it belongs to. Its ``make_config`` puts the roles on the
in-process bus (``memory://``), so the role loops' tests run here (tests/unit/test_trainer_loop*.py)."""

from __future__ import annotations

import pytest

TIER = "unit tests run without a broker: move this test to tests/integration"


@pytest.fixture(scope="session")
def broker():
    pytest.fail(TIER, pytrace=False)


@pytest.fixture(autouse=True)
def _no_broker_starts(monkeypatch):
    """Starting the local broker from a unit test (``stream_rl.broker.up``) fails the test, naming its tier."""
    import stream_rl.broker

    def refuse(*args, **kwargs):
        pytest.fail(TIER, pytrace=False)

    monkeypatch.setattr(stream_rl.broker, "up", refuse)


@pytest.fixture
def durable_broker():
    pytest.fail(TIER, pytrace=False)


@pytest.fixture(scope="session")
def demo_build():
    pytest.fail("unit tests do not build the demo (about 90 s): move this test to tests/integration", pytrace=False)


@pytest.fixture
def make_config(tmp_path, run_name):
    """The unit tier's ``make_config``: the same overrides as the integration one (tests/conftest.py), on a fresh
    in-process bus (``memory://<run name>``, :mod:`stream_rl.transport.memory`) instead of the broker; the bus is
    forgotten at the end."""
    from support.memory_bus import memory_config

    from stream_rl.transport import memory

    def _make(**overrides):
        if memory.memory_name(overrides.get("kafka.bootstrap_servers", f"memory://{run_name}")) is None:
            pytest.fail(TIER, pytrace=False)
        run_dir = overrides.pop("run_dir", tmp_path / "run")
        return memory_config(run_name, run_dir, **overrides)

    yield _make
    memory.reset(run_name)



@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """The tests' chat tokenizer saved once per module (support.chat.save_chat_tokenizer)."""
    from support.chat import save_chat_tokenizer

    return save_chat_tokenizer(tmp_path_factory.mktemp("chat"))
