"""The transport edge against a broker that lost topics or vanished: no client re-creates a topic, a send to a
missing topic names it and the command that creates it, and a role whose broker is gone stops with
BrokerUnreachable naming it within ``kafka.broker_timeout_s`` (instead of logging errors forever)."""

from __future__ import annotations

import time
import uuid

import pytest
from support.scorer import ScorerThread, group_rollouts, send_rollouts
from support.topics import read_records
from support.waiting import wait_for

from consumers.scorer.config import ScorerConfig
from schemas import Heartbeat
from stream_rl.transport import BrokerUnreachable, TopicError
from stream_rl.transport.client import Transport

pytestmark = pytest.mark.broker


def beat(instance: str = "scorer-x") -> Heartbeat:
    return Heartbeat(role="scorer", instance_id=instance, host="h", pid=1, state="ready", policy_version=0, step=0)


def test_a_deleted_topic_is_not_recreated_and_a_send_to_it_names_it_and_the_command(make_config):
    cfg = make_config(**{"kafka.broker_timeout_s": 3.0})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    sink.send(t.names.status, beat(), key="scorer-x")
    sink.flush()  # the producer now tracks the status topic in its metadata
    admin = t.admin()
    try:
        admin.delete_topics([t.names.status])
        wait_for(lambda: t.names.status not in admin.list_topics(), "the status topic deleted", 10)
        started = time.monotonic()
        with pytest.raises(TopicError) as info:  # once the producer's metadata (10 s old at most) shows it gone
            while time.monotonic() - started < 30:
                sink.send(t.names.status, beat(), key="scorer-x")
                sink.flush()
                time.sleep(0.5)
        assert time.monotonic() - started < 10 + 3.0 + 3.0  # metadata age + kafka.broker_timeout_s, not a hang
        assert t.names.status in str(info.value) and "stream-rl topics create" in str(info.value)
        time.sleep(1.0)  # metadata refreshes in flight would have re-created it by now
        assert t.names.status not in admin.list_topics()
    finally:
        admin.close()
        sink.close()


@pytest.fixture
def private_broker(tmp_path):
    """A tansu of this test alone (memory storage), so the test can kill it."""
    from stream_rl import broker as broker_mod
    from stream_rl.config.sections import BrokerConfig

    cfg = BrokerConfig(state_dir=tmp_path / "private-broker", storage="memory")
    state = broker_mod.up(cfg)
    yield cfg, state
    broker_mod.down(cfg)


def test_a_scorer_whose_broker_vanished_stops_with_an_error_naming_it(private_broker, tmp_path):
    from stream_rl import broker as broker_mod
    from stream_rl.cli.config import load_config

    bcfg, state = private_broker
    timeout_s = 8.0  # short for the test, yet long enough that a busy machine's broker (the suite runs on two workers)
    # is not taken for a vanished one while the scorer works
    cfg = load_config(None, env={}, overrides={
        "kafka.bootstrap_servers": state.bootstrap, "topics.run": f"t{uuid.uuid4().hex[:10]}",
        "run_dir": str(tmp_path / "run"), "kafka.broker_timeout_s": timeout_s,
        "telemetry.heartbeat_interval_s": 1.0})
    t = Transport(cfg, "test")
    t.ensure_topics()
    send_rollouts(t, group_rollouts(0, 1))
    scorer = ScorerThread(cfg, ScorerConfig(reward_fn="consumers.scorer.builtin_rewards:exact_match",
                                            batch_size=4, poll_timeout_s=0.3))
    wait_for(lambda: len(read_records(t, t.names.scored)) >= 4, "the scorer at work", 40, watch=[scorer])
    broker_mod.down(bcfg)  # the broker vanishes under the running scorer
    gone = time.monotonic()
    scorer.thread.join(timeout_s + 40)
    assert not scorer.thread.is_alive(), "the scorer kept running without a broker"
    assert isinstance(scorer.error, BrokerUnreachable), repr(scorer.error)
    assert state.bootstrap in str(scorer.error) and "kafka.broker_timeout_s=8" in str(scorer.error)
    assert time.monotonic() - gone < timeout_s + 40
