"""An in-process bus with the Kafka edge's contract: roles and their tests run on it without a broker.

Consumes: ``kafka.bootstrap_servers = "memory://<name>"`` (:class:`~stream_rl.transport.client.Transport` builds
these clients instead of kafka-python's); every client of one name shares one :class:`Bus` (:func:`bus`).
Produces: :class:`MemoryProducer`, :class:`MemoryConsumer` and :class:`MemoryAdmin`, the subset of kafka-python's
``KafkaProducer`` / ``KafkaConsumer`` / ``KafkaAdminClient`` interface that :class:`~stream_rl.transport.edge.Sink`,
:class:`~stream_rl.transport.edge.Source` and the transport helpers use, with kafka-python's record, partition and
error types (so the edge cannot tell them apart).
Guarantees (what ``tests/integration/test_edge_contract.py`` checks against both backends):
- Topics have partitions and consecutive offsets from 0; a keyed record goes to ``murmur2(key) % partitions``
  (kafka-python's and the Java client's placement), an unkeyed one round-robin; key, value, headers and a
  timestamp are kept. A send to a missing topic raises ``TopicError`` (no client creates topics).
- A send is acknowledged (and becomes readable) at ``flush``, or when its future is waited on::

      send ──> pending ──flush()──> appended to the partition log ──> future resolved (RecordMetadata)

- Consumer groups: committed offsets per group; subscribed members split each topic's partitions (range
  assignment over members in join order) and the group rebalances when a member joins or closes (a close
  always leaves: there is no broker to expire it). A member learns its new assignment at its next ``poll``
  (revoked, then assigned, through its rebalance listener), as with kafka-python; until then a commit of a
  partition the group gave away raises ``CommitFailedError``. A member that assigns partitions itself commits
  with no generation, refused while the group has subscribed members.
- A partition is read from the consumer's position: the group's committed offset, else the earliest record.
- ``highwater`` is the partition's current end (kafka-python's comes from the last fetch response).
Everything is guarded by one lock per bus; ``poll`` waits on its condition, so threads may share a bus.
"""

from __future__ import annotations

import itertools
import threading
import time

from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import MessageSizeTooLargeError
from kafka.partitioner.default import murmur2
from kafka.producer.future import RecordMetadata
from kafka.structs import TopicPartition

from stream_rl.transport.memory_clients import MemoryAdmin, MemoryConsumer
from stream_rl.transport.topics import TopicError

SCHEME = "memory://"


def memory_name(bootstrap: str | None) -> str | None:
    """The bus name of a ``memory://<name>`` bootstrap address, None for a Kafka one."""
    if bootstrap and bootstrap.startswith(SCHEME):
        return bootstrap[len(SCHEME):] or "default"
    return None


class _Group:
    def __init__(self) -> None:
        self.committed: dict[TopicPartition, int] = {}
        self.members: list[MemoryConsumer] = []  # subscribed members, in join order
        self.generation = 0
        self.owner: dict[TopicPartition, MemoryConsumer] = {}


class Bus:
    """Topics (a list of records per partition), topic configs and consumer groups of one named bus."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cond = threading.Condition(threading.RLock())
        self.logs: dict[str, list[list[ConsumerRecord]]] = {}
        self.configs: dict[str, dict[str, str]] = {}
        self.groups: dict[str, _Group] = {}

    def partitions(self, topic: str) -> list[list[ConsumerRecord]]:
        if topic not in self.logs:
            raise TopicError(f"topic {topic} does not exist on {SCHEME}{self.name} (roles never create "
                             f"topics): create the run's topics with `stream-rl topics create`")
        return self.logs[topic]

    def group(self, group_id: str) -> _Group:
        return self.groups.setdefault(group_id, _Group())

    def rebalance(self, group: _Group) -> None:
        """Range-assign every subscribed topic's partitions over the group's members (caller holds the lock)."""
        group.generation += 1
        group.owner = {}
        for topic in sorted({t for m in group.members for t in m._topics}):
            members = [m for m in group.members if topic in m._topics]
            count = len(self.logs.get(topic, ()))
            for index, member in enumerate(members):
                lo, hi = index * count // len(members), (index + 1) * count // len(members)
                for p in range(lo, hi):
                    group.owner[TopicPartition(topic, p)] = member
        self.cond.notify_all()


_BUSES: dict[str, Bus] = {}
_BUSES_LOCK = threading.Lock()


def bus(name: str) -> Bus:
    """The bus called ``name`` (created on first use): every client of ``memory://<name>`` shares it."""
    with _BUSES_LOCK:
        return _BUSES.setdefault(name, Bus(name))


def reset(name: str | None = None) -> None:
    """Forget bus ``name`` (every bus when None): its topics, records and groups (tests)."""
    with _BUSES_LOCK:
        if name is None:
            _BUSES.clear()
        else:
            _BUSES.pop(name, None)


class _Future:
    """A send's future: resolved when its producer flushes (``get`` flushes it first)."""

    def __init__(self, producer: MemoryProducer) -> None:
        self._producer = producer
        self.value: RecordMetadata | None = None

    def get(self, timeout: float | None = None) -> RecordMetadata:
        if self.value is None:
            self._producer.flush(timeout)
        return self.value


class MemoryProducer:
    """``KafkaProducer``'s ``send`` / ``flush`` / ``close`` on a :class:`Bus`."""

    def __init__(self, bus_: Bus, max_request_size: int = 1_048_576) -> None:
        self.bus = bus_
        self.max_request_size = max_request_size
        self._pending: list[tuple[_Future, str, int, ConsumerRecord]] = []
        self._round_robin = itertools.count()

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None, headers=None,
             partition: int | None = None, timestamp_ms: int | None = None) -> _Future:
        with self.bus.cond:
            count = len(self.bus.partitions(topic))
        size = len(value or b"") + len(key or b"") + sum(len(k) + len(v or b"") for k, v in headers or ())
        if size > self.max_request_size:
            raise MessageSizeTooLargeError(f"The message is {size} bytes when serialized which is larger than "
                                           f"the maximum request size you have configured with the "
                                           f"max_request_size configuration")
        if partition is None:
            partition = (murmur2(key) & 0x7FFFFFFF) % count if key is not None else next(self._round_robin) % count
        stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        record = ConsumerRecord(topic, partition, -1, -1, stamp, 0, key, value, list(headers or ()), None,
                                len(key or b""), len(value or b""), -1)
        future = _Future(self)
        self._pending.append((future, topic, partition, record))
        return future

    def flush(self, timeout: float | None = None) -> None:
        with self.bus.cond:
            pending, self._pending = self._pending, []
            for future, topic, partition, record in pending:
                log = self.bus.partitions(topic)[partition]
                log.append(record._replace(offset=len(log)))
                future.value = RecordMetadata(topic, partition, TopicPartition(topic, partition), len(log) - 1,
                                              record.timestamp, None, record.serialized_key_size,
                                              record.serialized_value_size, -1)
            self.bus.cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        self.flush(timeout)


__all__ = ["SCHEME", "Bus", "MemoryAdmin", "MemoryConsumer", "MemoryProducer", "bus", "memory_name", "reset"]
