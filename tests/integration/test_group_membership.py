"""Consumer groups stay joinable however a member stops (a tansu 0.6 quirk, worked around in the transport edge).

tansu 0.6 mishandles a LeaveGroup that lands while its group is rebalancing: the group then hands no partition
to anyone for minutes. ``close_consumer`` sends none by default (``kafka.leave_group_on_close``); the broker
expires a stopped member after the session timeout, so the next member is assigned within seconds.
"""

from __future__ import annotations

import time

import pytest

from stream_rl.config.sections import KafkaConfig
from stream_rl.transport.membership import AssignmentWatch, NoAssignment, close_consumer
from stream_rl.transport.settings import consumer_settings

pytestmark = pytest.mark.broker


def _member(bootstrap: str, group: str, topic: str):
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(**consumer_settings(KafkaConfig(), bootstrap, group))
    consumer.subscribe([topic])
    return consumer


def _poll_for(consumer, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        consumer.poll(timeout_ms=100)


def _assigned_within(consumer, seconds: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        consumer.poll(timeout_ms=200)
        if consumer.assignment():
            return time.monotonic() - start
    return None


@pytest.fixture
def topic(broker, run_name):
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(f"{run_name}.g", 4, 1)])
    admin.close()
    return f"{run_name}.g"


def test_a_member_closed_during_its_first_join_leaves_the_group_joinable(broker, run_name, topic):
    first = _member(broker.bootstrap, f"{run_name}.grp", topic)
    _poll_for(first, 1.0)  # joins are held for session_timeout/2 (3 s): it is still joining
    assert not first.assignment()
    close_consumer(first)
    second = _member(broker.bootstrap, f"{run_name}.grp", topic)
    try:
        took = _assigned_within(second, 40.0)
        assert took is not None, "the next member got no partition in 40 s"
        assert len(second.assignment()) == 4
    finally:
        close_consumer(second)


def _poll_each_in_its_own_thread(members, seconds: float, until=lambda: False) -> None:
    """Poll every member from its own thread, as separate processes would. One thread polling them in turn can
    starve a member's join or sync (a poll blocks while the broker holds a join), so a settled group is not
    guaranteed that way."""
    import threading

    deadline = time.monotonic() + seconds

    def run(member) -> None:
        while time.monotonic() < deadline and not until():
            member.poll(timeout_ms=100)

    threads = [threading.Thread(target=run, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)


def test_members_closed_during_a_rebalance_leave_the_group_joinable(broker, run_name, topic):
    group = f"{run_name}.grp"
    a, b = _member(broker.bootstrap, group, topic), _member(broker.bootstrap, group, topic)
    _poll_each_in_its_own_thread((a, b), 60.0, until=lambda: bool(a.assignment() and b.assignment()))
    assert a.assignment() and b.assignment(), "two members polling on their own did not settle in 60 s"
    c = _member(broker.bootstrap, group, topic)  # triggers a rebalance
    _poll_each_in_its_own_thread((a, b, c), 1.0)
    for member in (a, b, c):  # all stop mid-rebalance, as `stream-rl run` stopping its roles can
        close_consumer(member)
    d = _member(broker.bootstrap, group, topic)
    try:
        assert _assigned_within(d, 40.0) is not None, "the next member got no partition in 40 s"
    finally:
        close_consumer(d)


def test_stable_members_closed_one_after_another_leave_the_group_joinable(broker, run_name, topic):
    """With a LeaveGroup from each, the second leave can land in the rebalance the first started (1 of 3 tries
    broke the group when measured); without, both are expired."""
    group = f"{run_name}.pair"
    a, b = _member(broker.bootstrap, group, topic), _member(broker.bootstrap, group, topic)
    _poll_each_in_its_own_thread((a, b), 60.0, until=lambda: bool(a.assignment() and b.assignment()))
    assert a.assignment() and b.assignment(), "two members polling on their own did not settle in 60 s"
    close_consumer(a)
    close_consumer(b)
    d = _member(broker.bootstrap, group, topic)
    try:
        assert _assigned_within(d, 40.0) is not None, "the next member got no partition in 40 s"
        assert len(d.assignment()) == 4
    finally:
        close_consumer(d)


def test_a_stable_member_closed_with_leave_hands_its_partitions_over_before_it_could_expire(broker, run_name,
                                                                                             topic):
    """``leave=True`` (``kafka.leave_group_on_close``, for Apache Kafka) does send the LeaveGroup: the next
    member is assigned sooner than the broker could have expired the first (session timeout 6 s)."""
    group = f"{run_name}.solo"
    first = _member(broker.bootstrap, group, topic)
    assert _assigned_within(first, 30.0) is not None
    close_consumer(first, leave=True)
    second = _member(broker.bootstrap, group, topic)
    try:
        took = _assigned_within(second, 40.0)
        assert took is not None and took < KafkaConfig().session_timeout_ms / 1000, took
    finally:
        close_consumer(second)


def test_a_member_whose_group_never_settles_stops_with_an_error_naming_the_group(broker, run_name, topic):
    group = f"{run_name}.stuck"
    first = _member(broker.bootstrap, group, topic)
    _poll_for(first, 1.0)
    first.close(autocommit=False)  # the plain close: LeaveGroup mid-join leaves this group unjoinable on tansu
    stuck = _member(broker.bootstrap, group, topic)
    watch = AssignmentWatch(timeout_s=6.0)
    try:
        with pytest.raises(NoAssignment, match=rf"no partition of {topic} assigned in group {group} within 6s"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                stuck.poll(timeout_ms=200)
                watch.check(stuck)
    finally:
        close_consumer(stuck)


def test_a_member_of_a_settled_group_with_no_partition_for_it_idles(broker, run_name, caplog):
    """Two members (each polling in its own thread, as two processes would), one partition: one member idles
    well past the bound without being stopped, and says so once."""
    import threading

    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    single = f"{run_name}.one"
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(single, 1, 1)])
    admin.close()
    group = f"{run_name}.idle"
    members = [_member(broker.bootstrap, group, single) for _ in range(2)]
    errors: list[BaseException] = []

    def run(member) -> None:
        watch = AssignmentWatch(timeout_s=12.0)
        deadline = time.monotonic() + 30  # well past the bound
        try:
            while time.monotonic() < deadline:
                member.poll(timeout_ms=200)
                watch.check(member)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,)) for m in members]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert sorted(len(m.assignment()) for m in members) == [0, 1]
        assert "gave this member no partition" in caplog.text
    finally:
        for m in members:
            close_consumer(m)
