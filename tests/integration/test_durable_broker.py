"""The embedded broker's durable storage (tansu ``s3://`` on a local SeaweedFS): what survives a kill -9.

Each test starts its own durable broker in a temporary state directory (the session broker uses memory storage).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from stream_rl import broker as broker_mod
from stream_rl.broker import object_store
from stream_rl.config.sections import BrokerConfig

pytestmark = pytest.mark.broker


def _produce(bootstrap: str, topic: str, n: int) -> None:
    from kafka import KafkaAdminClient, KafkaProducer
    from kafka.admin import NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 2, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for i in range(n):
        producer.send(topic, key=str(i).encode(), value=f"v{i}".encode())
    producer.flush()
    producer.close()


def _consume_and_commit(bootstrap: str, topic: str, n: int) -> dict[int, int]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id="g", auto_offset_reset="earliest",
                             enable_auto_commit=False, session_timeout_ms=6000, heartbeat_interval_ms=2000)
    seen, deadline = 0, time.monotonic() + 60
    while seen < n and time.monotonic() < deadline:
        seen += sum(len(r) for r in consumer.poll(500, max_records=n - seen).values())
    consumer.commit()
    committed = {tp.partition: consumer.committed(tp) for tp in consumer.assignment()}
    consumer.close()
    assert seen == n
    return committed


def _committed(bootstrap: str, topic: str) -> dict[int, int | None]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id="g", enable_auto_commit=False)
    try:
        return {p: consumer.committed(TopicPartition(topic, p)) for p in (0, 1)}
    finally:
        consumer.close()


def _values(bootstrap: str, topic: str) -> list[bytes]:
    from kafka import KafkaConsumer, TopicPartition

    reader = KafkaConsumer(bootstrap_servers=bootstrap, consumer_timeout_ms=4000)
    reader.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
    reader.seek_to_beginning()
    values = [m.value for m in reader]
    reader.close()
    return values


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)  # our child: reap it so its PID is gone
    except ChildProcessError:
        pass


@pytest.mark.parametrize("victims", ["broker", "broker+store"])
def test_kill9_keeps_every_acknowledged_record_and_committed_offset(durable_broker, victims):
    state = broker_mod.read_state(durable_broker.state_dir)
    _produce(state.bootstrap, "k", 300)
    committed = _consume_and_commit(state.bootstrap, "k", 120)
    assert sum(committed.values()) == 120

    _kill(state.pid)
    if victims == "broker+store":
        _kill(object_store.read_state(durable_broker.state_dir).pid)
    assert not broker_mod.status(durable_broker)[0]
    again = broker_mod.up(durable_broker)

    assert again.bootstrap == state.bootstrap  # the recorded port again: clients reconnect where they were
    assert again.pid != state.pid
    assert _committed(again.bootstrap, "k") == committed
    values = _values(again.bootstrap, "k")
    assert sorted(values) == sorted(f"v{i}".encode() for i in range(300))  # each record once, none lost


def test_status_names_a_dead_store(durable_broker):
    store = object_store.read_state(durable_broker.state_dir)
    _kill(store.pid)
    ok, message = broker_mod.status(durable_broker)
    assert not ok and "object store is not running" in message
    broker_mod.up(durable_broker)  # restarts the store under the running broker
    assert broker_mod.status(durable_broker) == (True, f"broker {broker_mod.read_state(durable_broker.state_dir).bootstrap} "
                                                "is reachable (storage: durable)")


def test_memory_storage_loses_everything_on_kill(tmp_path):
    """The contrast the docs state: memory storage keeps nothing across a broker crash."""
    cfg = BrokerConfig(state_dir=tmp_path / "mem", storage="memory")
    state = broker_mod.up(cfg)
    try:
        _produce(state.bootstrap, "m", 10)
        _kill(state.pid)
        again = broker_mod.up(cfg)
        from kafka import KafkaConsumer

        consumer = KafkaConsumer(bootstrap_servers=again.bootstrap)
        assert "m" not in consumer.topics()
        consumer.close()
        assert not (tmp_path / "mem" / "store.json").exists()
    finally:
        broker_mod.down(cfg)


def test_missing_store_binary_is_one_clear_error(tmp_path):
    cfg = BrokerConfig(state_dir=tmp_path / "nobin", storage="durable", store_binary=tmp_path / "no-weed")
    with pytest.raises(broker_mod.BrokerError, match="durable storage: weed binary not found at .*no-weed"):
        broker_mod.up(cfg)
    assert broker_mod.read_state(cfg.state_dir) is None


def test_a_filesystem_without_room_for_the_store_is_refused_at_start_naming_it(tmp_path):
    """Below 1 % free SeaweedFS turns every volume read-only and the broker's writes time out naming nothing; the
    store now refuses to start instead, naming the free space, the path and the setting (here: more room asked
    than any disk has, through the real CLI)."""
    import subprocess
    import sys

    state_dir = tmp_path / "full"
    run = subprocess.run([sys.executable, "-m", "stream_rl.cli.main", "broker", "up", "--state-dir", str(state_dir),
                          "--set", "broker.store_min_free_gib=1000000"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("broker up failed: durable storage: only ") and "GiB free on the filesystem of " in line
    assert str((state_dir / "store").resolve()) in line and "broker.store_min_free_gib = 1e+06" in line
    assert 'broker.storage = "memory"' in line
    assert broker_mod.read_state(state_dir) is None and object_store.read_state(state_dir) is None


def test_the_room_the_store_needs_is_one_percent_of_the_filesystem_plus_the_setting():
    gib = object_store.GIB
    where = Path("/data")
    assert object_store.space_problem(2 * gib + 1, 100 * gib, 1.0, where) is None  # needs more than 1 + 1 GiB
    problem = object_store.space_problem(2 * gib, 100 * gib, 1.0, where)
    assert problem is not None and problem.startswith("only 2.0 GiB free on the filesystem of /data (100.0 GiB)")
    assert "needs more than 2.0 GiB" in problem
    assert object_store.space_problem(int(10.5 * gib), 1000 * gib, 0.0, where) is None  # 1 % of 1000 GiB: 10
    assert object_store.space_problem(10 * gib, 1000 * gib, 0.0, where) is not None
