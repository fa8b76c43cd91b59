"""The unit tier runs without a broker and without starting a process: a unit test that asks for the broker (or a
fixture built on it) fails at once, naming the tier it belongs to."""

from __future__ import annotations

import pytest

TIER = "unit tests run without a broker: move this test to tests/integration"


@pytest.fixture(scope="session")
def broker():
    pytest.fail(TIER, pytrace=False)


@pytest.fixture
def durable_broker():
    pytest.fail(TIER, pytrace=False)


@pytest.fixture(scope="session")
def demo_build():
    pytest.fail("unit tests do not build the demo (about 90 s): move this test to tests/integration", pytrace=False)
