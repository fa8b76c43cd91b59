"""The transport edge against the real local broker: round trips, dead letters, groups, commits, trace context."""

from __future__ import annotations

import time

import msgpack
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import messages as samples
from support.topics import read_values

from schemas import DeadLetter, encode
from stream_rl.transport.client import Transport
from stream_rl.transport.tracing import Tracing

pytestmark = pytest.mark.broker


def _drain(source, want: int, timeout_s: float = 30.0, max_records=None) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got.extend(source.poll(0.5, max_records=max_records))
    return got


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
def test_every_kind_round_trips_through_the_broker(make_config, compression):
    cfg = make_config(**{"kafka.compression": compression})
    t = Transport(cfg, f"test-{compression}")
    t.ensure_topics()
    sink = t.sink()
    sent = samples.every_kind()
    for msg in sent:
        sink.send(t.names.status, msg, key=getattr(msg, "KIND", "k"))
    acks = sink.flush()
    assert len(acks) == len(sent)
    source = t.source([t.names.status], f"g-roundtrip-{compression}", None, sink)
    got = _drain(source, len(sent))
    assert [c.value for c in got] == sent  # one partition: order kept; equality compares arrays and dtypes
    assert source.dead_lettered == 0


def test_invalid_records_go_to_dlq_and_good_ones_around_them_are_processed(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 1, "dlq": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    good_a, good_b = samples.rollout(1), samples.rollout(2)
    wrong_version = msgpack.unpackb(encode(samples.rollout(3)), raw=False)
    wrong_version["schema_version"] = 99
    sink.send(t.names.rollouts, good_a, key=good_a.group_id)
    sink.send_raw(t.names.rollouts, b"\xc1garbage\xff", key=b"junk")
    sink.send_raw(t.names.rollouts, msgpack.packb(wrong_version, use_bin_type=True), key=b"future")
    sink.send(t.names.rollouts, good_b, key=good_b.group_id)
    sink.flush()

    source = t.source([t.names.rollouts], "g-dlq", "rollout", sink)
    got = _drain(source, 2)
    assert [c.value.rollout_id for c in got] == [good_a.rollout_id, good_b.rollout_id]
    assert [c.offset for c in got] == [0, 3]
    assert source.dead_lettered == 2
    sink.flush()
    assert source.commit()

    dlq = t.source([t.names.dlq], "g-dlq-reader", "dead_letter", sink)
    letters = [c.value for c in _drain(dlq, 2)]
    assert all(isinstance(x, DeadLetter) for x in letters)
    by_offset = {x.source_offset: x for x in letters}
    assert set(by_offset) == {1, 2}
    assert by_offset[1].raw_value == b"\xc1garbage\xff" and by_offset[1].raw_key == b"junk"
    assert by_offset[1].source_topic == t.names.rollouts and by_offset[1].source_partition == 0
    assert "schema_version" in by_offset[2].reason and "99" in by_offset[2].reason
    assert by_offset[2].error_type == "SchemaError"

    # the group's committed position is past all four records: a restart reads nothing again
    again = t.source([t.names.rollouts], "g-dlq", "rollout", t.sink())
    assert _drain(again, 1, timeout_s=6) == []


def test_commit_refuses_before_outputs_are_acknowledged(make_config):
    t = Transport(make_config(), "test")
    t.ensure_topics()
    sink = t.sink()
    sink.send(t.names.rollouts, samples.rollout(0), key=samples.rollout(0).group_id)
    sink.flush()
    source = t.source([t.names.rollouts], "g-order", "rollout", sink)
    assert len(_drain(source, 1)) == 1
    sink.send(t.names.scored, samples.scored(0), key=samples.scored(0).group_id)
    with pytest.raises(RuntimeError, match="flush"):
        source.commit()
    sink.flush()
    assert source.commit()


def test_two_consumers_in_one_group_split_partitions_and_read_everything_once(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 4}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    sent = [samples.rollout(i, s) for i in range(10) for s in range(4)]
    for r in sent:
        sink.send(t.names.rollouts, r, key=r.group_id)
    sink.flush()
    a = t.source([t.names.rollouts], "g-split", "rollout", sink)
    b = t.source([t.names.rollouts], "g-split", "rollout", sink)
    # wait until the group has settled with both members owning partitions
    deadline = time.monotonic() + 40
    got_a, got_b = [], []
    while time.monotonic() < deadline and len(got_a) + len(got_b) < len(sent):
        for src, acc in ((a, got_a), (b, got_b)):
            acc.extend(src.poll(0.3, max_records=3))
            sink.flush()
            src.commit()
    assert len(got_a) + len(got_b) == len(sent)
    ids = [c.value.rollout_id for c in got_a + got_b]
    assert sorted(ids) == sorted(r.rollout_id for r in sent) and len(set(ids)) == len(ids)
    parts_a = {c.partition for c in got_a}
    parts_b = {c.partition for c in got_b}
    assert parts_a and parts_b and not parts_a & parts_b
    # a group keeps each GRPO group on one partition (keyed by group id)
    by_group = {}
    for c in got_a + got_b:
        by_group.setdefault(c.value.group_id, set()).add(c.partition)
    assert all(len(p) == 1 for p in by_group.values())


def test_restart_resumes_after_last_commit_without_loss_or_reread(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 2}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    sent = [samples.rollout(i, s) for i in range(6) for s in range(2)]
    for r in sent:
        sink.send(t.names.rollouts, r, key=r.group_id)
    sink.flush()
    first = t.source([t.names.rollouts], "g-restart", "rollout", sink)
    part1 = _drain(first, 5, max_records=5)[:5]
    # commit exactly the records handled so far (one past each partition's last handled offset)
    from kafka import TopicPartition
    handled = {}
    for c in part1:
        handled[TopicPartition(c.topic, c.partition)] = max(handled.get(TopicPartition(c.topic, c.partition), 0),
                                                            c.offset + 1)
    sink.flush()
    assert first.commit(handled)
    first.close()  # a crash after the commit: nothing past `handled` was processed

    second = t.source([t.names.rollouts], "g-restart", "rollout", t.sink())
    part2 = _drain(second, len(sent) - len(part1))
    ids1 = [c.value.rollout_id for c in part1]
    ids2 = [c.value.rollout_id for c in part2]
    assert not set(ids1) & set(ids2)
    assert sorted(ids1 + ids2) == sorted(r.rollout_id for r in sent)


def test_traceparent_parents_the_processing_span(make_config):
    exporter = InMemorySpanExporter()
    tracing = Tracing("test", exporter)
    t = Transport(make_config(), "test", tracing=tracing)
    t.ensure_topics()
    sink = t.sink()
    sink.send(t.names.rollouts, samples.rollout(0), key=samples.rollout(0).group_id)
    sink.send(t.names.rollouts, samples.rollout(1), key=samples.rollout(1).group_id)
    sink.flush()
    source = t.source([t.names.rollouts], "g-trace", "rollout", sink)
    got = _drain(source, 2)
    assert all(dict(c.headers).get("traceparent") for c in got)
    with source.process_span("score", [got[0]]):
        pass
    with source.process_span("train-step", got):
        pass
    spans = exporter.get_finished_spans()
    sends = [s for s in spans if s.name == f"send {t.names.rollouts}"]
    single = next(s for s in spans if s.name == "process score")
    batch = next(s for s in spans if s.name == "process train-step")
    traceparent = dict(got[0].headers)["traceparent"].decode()
    send0 = next(s for s in sends if f"{s.context.span_id:016x}" in traceparent)
    assert single.parent is not None and single.parent.span_id == send0.context.span_id
    assert single.context.trace_id == send0.context.trace_id
    assert batch.parent is None
    assert {link.context.span_id for link in batch.links} == {s.context.span_id for s in sends}


def test_highwaters_count_records_from_fetch_responses(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 3}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    for i in range(7):
        sink.send(t.names.rollouts, samples.rollout(i), key=samples.rollout(i).group_id, partition=i % 3)
    sink.flush()
    with t.reader() as reader:
        tps = reader.partitions(t.names.rollouts)
        marks = reader.highwaters(tps)
    assert tps == [(t.names.rollouts, p) for p in range(3)] and [marks[tp] for tp in tps] == [3, 2, 2]



def test_ensure_topics_is_idempotent_and_reports_a_partition_mismatch(make_config):
    from stream_rl.transport import TopicError

    cfg = make_config(**{"topics.partitions": {"rollouts": 3}})
    first = Transport(cfg, "test").ensure_topics()
    again = Transport(cfg, "test").ensure_topics()
    assert first == again and first[Transport(cfg, "test").names.rollouts] == 3
    other = make_config(**{"topics.run": cfg.topics.run, "topics.partitions": {"rollouts": 5}})
    with pytest.raises(TopicError, match="has 3 partitions, config wants 5"):
        Transport(other, "test").ensure_topics()


def test_a_role_input_without_its_documented_key_is_dead_lettered(make_config):
    """Keys decide partitions (murmur2 of the key): a rollout not keyed by its group id could split its group."""
    cfg = make_config(**{"topics.partitions": {"rollouts": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    keyed, unkeyed, wrong = samples.rollout(0), samples.rollout(1), samples.rollout(2)
    sink.send(t.names.rollouts, keyed, key=keyed.group_id)
    sink.send(t.names.rollouts, unkeyed)
    sink.send(t.names.rollouts, wrong, key="producer-7")
    sink.flush()
    source = t.source([t.names.rollouts], "g-keys", "rollout", sink)
    got = _drain(source, 1)
    sink.flush()
    assert [c.value.rollout_id for c in got] == [keyed.rollout_id]
    letters = read_values(t, t.names.dlq, "dead_letter")
    assert [(d.source_offset, d.error_type) for d in letters] == [(1, "KeyError"), (2, "KeyError")]
    assert "is not the documented key (group_id" in letters[0].reason
    source.close()
    sink.close()
