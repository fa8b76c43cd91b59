"""The transport edge's delivery contract (stream_rl/transport/edge.py), checked against both backends.

Every test runs twice: on the in-process bus (``memory://``, milliseconds) and on the real local broker
(``kafka``). Consumer groups are named after the test's run: a member another test left open never joins them. Waits are bounded polls (until a condition or a deadline), and "nothing more arrives" is checked
with positions against high-water marks, never with a quiet sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack
import pytest
from kafka.partitioner.default import murmur2
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import messages as samples

from schemas import DeadLetter, encode
from stream_rl.transport import memory
from stream_rl.transport.client import Transport
from stream_rl.transport.tracing import Tracing


class Backend:
    """Transport-level factory for one backend: config, topics, sinks and sources, and the waits that fit it."""

    def __init__(self, kind: str, make_config: Callable, wait_s: float):
        self.kind, self._make_config, self.wait_s = kind, make_config, wait_s

    def transport(self, partitions: dict[str, int] | None = None, tracing: Tracing | None = None) -> Transport:
        cfg = self._make_config(**({"topics.partitions": partitions} if partitions else {}))
        t = Transport(cfg, f"contract-{self.kind}", tracing=tracing)
        t.ensure_topics()
        return t


@pytest.fixture(params=["memory", "kafka"])
def backend(request, tmp_path, run_name):
    if request.param == "kafka":
        yield Backend("kafka", request.getfixturevalue("make_config"), wait_s=60.0)
        return
    from stream_rl.cli.config import load_config

    def make(**overrides):
        base = {"kafka.bootstrap_servers": f"memory://{run_name}", "topics.run": run_name,
                "run_dir": str(tmp_path / "run"), **overrides}
        return load_config(None, env={}, overrides=base)

    yield Backend("memory", make, wait_s=5.0)
    memory.reset(run_name)


def drain(source, want: int, timeout_s: float, max_records: int | None = None) -> list:
    """Poll until ``want`` records came (or the deadline); return what came."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got.extend(source.poll(0.3, max_records=max_records))
    return got


def at_end(source) -> bool:
    """Every assigned partition is read up to its high-water mark: nothing more is there to arrive."""
    assigned = source.assignment()
    return bool(assigned) and all(source.highwater(*tp) is not None and source.position(*tp) >= source.highwater(*tp)
                                  for tp in assigned)


def read_to_end(source, timeout_s: float) -> list:
    """Poll until every assigned partition is read to its high-water mark; return the records that came."""
    got, deadline = [], time.monotonic() + timeout_s
    while not at_end(source):
        assert time.monotonic() < deadline, f"not at the end of {source.assignment()} after {timeout_s}s"
        got.extend(source.poll(0.3))
    return got


def test_offsets_are_consecutive_and_records_keep_order_key_value_and_headers(backend):
    t = backend.transport({"rollouts": 3})
    sink = t.sink()
    sent = [samples.rollout(i, s) for i in range(6) for s in range(2)]
    for n, r in enumerate(sent):
        sink.send(t.names.rollouts, r, key=r.group_id, headers=[("x-seq", str(n).encode())])
    acks = sink.flush()
    by_partition: dict[int, list[int]] = {}
    for ack in acks:
        by_partition.setdefault(ack.partition, []).append(ack.offset)
    assert all(offs == list(range(len(offs))) for offs in by_partition.values())  # consecutive from 0
    for r, ack in zip(sent, acks):  # placement: murmur2 of the key, as kafka-python and the Java client do
        assert ack.partition == (murmur2(r.group_id.encode()) & 0x7FFFFFFF) % 3

    source = t.source([t.names.rollouts], f"{t.names.run}.g-order", "rollout", sink)
    got = drain(source, len(sent), backend.wait_s)
    assert len(got) == len(sent)
    for partition, offsets in by_partition.items():
        mine = [c for c in got if c.partition == partition]
        assert [c.offset for c in mine] == offsets  # in order, none missing
    for c in got:
        n = int(dict(c.headers)["x-seq"])
        assert c.value == sent[n] and c.key == sent[n].group_id.encode()
        assert acks[n].partition == c.partition and acks[n].offset == c.offset
    assert source.dead_lettered == 0
    source.close()
    sink.close()


def test_a_commit_refuses_while_sends_are_unflushed(backend):
    t = backend.transport({"rollouts": 1})
    sink = t.sink()
    sink.send(t.names.rollouts, samples.rollout(0), key=samples.rollout(0).group_id)
    sink.flush()
    source = t.source([t.names.rollouts], f"{t.names.run}.g-flush", "rollout", sink)
    assert len(drain(source, 1, backend.wait_s)) == 1
    sink.send(t.names.scored, samples.scored(0), key=samples.scored(0).group_id)
    with pytest.raises(RuntimeError, match="unacknowledged sends: call sink.flush"):
        source.commit()
    sink.flush()
    assert source.commit()
    assert source.committed(t.names.rollouts, 0) == 1
    source.close()
    sink.close()


def test_a_restart_in_the_same_group_resumes_after_the_committed_offset(backend):
    t = backend.transport({"rollouts": 2})
    sink = t.sink()
    sent = [samples.rollout(i, s) for i in range(6) for s in range(2)]
    for r in sent:
        sink.send(t.names.rollouts, r, key=r.group_id)
    sink.flush()
    first = t.source([t.names.rollouts], f"{t.names.run}.g-restart", "rollout", sink)
    part1 = drain(first, 5, backend.wait_s, max_records=5)[:5]
    handled: dict[tuple[str, int], int] = {}
    for c in part1:  # one past each partition's last handled record
        handled[(c.topic, c.partition)] = max(handled.get((c.topic, c.partition), 0), c.offset + 1)
    assert first.commit(handled)
    first.close()  # a crash after the commit: nothing past `handled` was processed

    second = t.source([t.names.rollouts], f"{t.names.run}.g-restart", "rollout", t.sink())
    part2 = drain(second, len(sent) - len(part1), backend.wait_s)
    ids1, ids2 = [c.value.rollout_id for c in part1], [c.value.rollout_id for c in part2]
    assert not set(ids1) & set(ids2)  # nothing twice
    assert sorted(ids1 + ids2) == sorted(r.rollout_id for r in sent)  # nothing lost
    assert min(c.offset for c in part2 if (c.topic, c.partition) in handled) >= min(handled.values())
    assert at_end(second)  # and nothing more is there: positions reached the high-water marks
    second.close()
    sink.close()


def test_two_members_split_the_partitions_and_the_survivor_takes_over_when_one_leaves(backend):
    t = backend.transport({"rollouts": 4})
    sink = t.sink()
    sent = [samples.rollout(i, s) for i in range(10) for s in range(4)]
    for r in sent:
        sink.send(t.names.rollouts, r, key=r.group_id)
    sink.flush()
    a = t.source([t.names.rollouts], f"{t.names.run}.g-split", "rollout", sink)
    b = t.source([t.names.rollouts], f"{t.names.run}.g-split", "rollout", sink)
    got: dict[str, list] = {"a": [], "b": []}
    deadline = time.monotonic() + backend.wait_s
    while time.monotonic() < deadline and len(got["a"]) + len(got["b"]) < len(sent):
        for name, src in (("a", a), ("b", b)):
            got[name].extend(src.poll(0.3, max_records=3))
            src.commit()
    ids = [c.value.rollout_id for c in got["a"] + got["b"]]
    assert sorted(ids) == sorted(r.rollout_id for r in sent) and len(set(ids)) == len(ids)  # every record once
    parts_a, parts_b = {c.partition for c in got["a"]}, {c.partition for c in got["b"]}
    assert parts_a and parts_b and not parts_a & parts_b
    by_group: dict[str, set[int]] = {}
    for c in got["a"] + got["b"]:  # a GRPO group stays on one partition (keyed by group id), so with one member
        by_group.setdefault(c.value.group_id, set()).add(c.partition)
    assert all(len(p) == 1 for p in by_group.values())

    b.close()  # b leaves: its partitions go to a, which resumes them from b's commits
    more = [samples.rollout(100 + i) for i in range(12)]
    for r in more:
        sink.send(t.names.rollouts, r, key=r.group_id)
    sink.flush()
    later, deadline = [], time.monotonic() + backend.wait_s
    while time.monotonic() < deadline and len(later) < len(more):
        later.extend(a.poll(0.3))
        a.commit()
    assert sorted(c.value.rollout_id for c in later) == sorted(r.rollout_id for r in more)
    assert a.assignment() == {(t.names.rollouts, p) for p in range(4)}
    assert {c.partition for c in later} & parts_b  # records of b's former partitions reached a
    assert at_end(a)
    a.close()
    sink.close()


def test_invalid_records_go_to_the_dead_letter_topic_with_reason_and_source_offset(backend):
    t = backend.transport({"rollouts": 1, "dlq": 1})
    sink = t.sink()
    good_a, good_b = samples.rollout(1), samples.rollout(2)
    wrong_version = msgpack.unpackb(encode(samples.rollout(3)), raw=False)
    wrong_version["schema_version"] = 99
    sink.send(t.names.rollouts, good_a, key=good_a.group_id)
    sink.send_raw(t.names.rollouts, b"\xc1garbage\xff", key=b"junk")
    sink.send_raw(t.names.rollouts, msgpack.packb(wrong_version, use_bin_type=True), key=b"future")
    sink.send(t.names.rollouts, samples.rollout(4), key=b"not-the-group-id")
    sink.send(t.names.rollouts, good_b, key=good_b.group_id)
    sink.flush()

    source = t.source([t.names.rollouts], f"{t.names.run}.g-dlq", "rollout", sink)
    got = drain(source, 2, backend.wait_s)
    assert [(c.offset, c.value.rollout_id) for c in got] == [(0, good_a.rollout_id), (4, good_b.rollout_id)]
    assert source.dead_lettered == 3
    sink.flush()
    assert source.commit()
    source.close()

    dlq = t.source([t.names.dlq], f"{t.names.run}.g-dlq-reader", "dead_letter", sink)
    letters = {c.value.source_offset: c.value for c in drain(dlq, 3, backend.wait_s)}
    assert set(letters) == {1, 2, 3} and all(isinstance(x, DeadLetter) for x in letters.values())
    assert letters[1].raw_value == b"\xc1garbage\xff" and letters[1].raw_key == b"junk"
    assert letters[1].source_topic == t.names.rollouts and letters[1].source_partition == 0
    assert letters[2].error_type == "SchemaError" and "schema_version" in letters[2].reason
    assert letters[3].error_type == "KeyError" and "group_id" in letters[3].reason
    dlq.close()

    again = t.source([t.names.rollouts], f"{t.names.run}.g-dlq", "rollout", t.sink())  # committed past all five
    assert read_to_end(again, backend.wait_s) == []
    assert again.committed(t.names.rollouts, 0) == 5
    again.close()
    sink.close()


def test_trace_headers_pass_through_and_parent_the_processing_span(backend):
    exporter = InMemorySpanExporter()
    t = backend.transport(tracing=Tracing("contract", exporter))
    sink = t.sink()
    for i in range(2):
        sink.send(t.names.rollouts, samples.rollout(i), key=samples.rollout(i).group_id)
    sink.flush()
    source = t.source([t.names.rollouts], f"{t.names.run}.g-trace", "rollout", sink)
    got = drain(source, 2, backend.wait_s)
    assert len(got) == 2
    sends = [s for s in exporter.get_finished_spans() if s.name == f"send {t.names.rollouts}"]
    parents = [dict(c.headers)["traceparent"].decode() for c in got]
    assert sorted(p.split("-")[2] for p in parents) == sorted(f"{s.context.span_id:016x}" for s in sends)
    with source.process_span("score", [got[0]]):
        pass
    span = next(s for s in exporter.get_finished_spans() if s.name == "process score")
    assert f"{span.parent.span_id:016x}" == parents[0].split("-")[2]
    source.close()
    sink.close()
