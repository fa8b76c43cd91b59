"""The transport edge against the real local broker, beyond the delivery contract that
tests/integration/test_edge_contract.py checks on both backends (offsets and order, commits after flush, restarts,
group splits and rebalances, dead letters, trace headers): every kind and codec round-trips, a batch span links
every record's send, high-water marks come from fetch responses, topics are ensured idempotently, and a role input
keyed wrong is dead-lettered."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support import messages as samples
from support.topics import read_values

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
    source.close()
    sink.close()


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
