"""Role logic that used to need a broker, on the in-process bus (``memory://``): each test runs in milliseconds.

- the trainer's positioner (:mod:`consumers.trainer.positions`): every scored partition assigned and read from
  the checkpoint's offset, else from the start; an offset the log no longer has is refused unless accepted;
- the producer's epoch gate (:mod:`producers.epoch_gate`): a partition is held at its first prompt of a closed
  epoch and released, from that very record, once every partition is past the epoch below; a partition of another
  producer counts from that producer's committed offset;
- the group-less :class:`~stream_rl.transport.reader.Reader` (partitions, high-water marks, ranges, following);
- the scorer's loop: batches of ``batch_size``, each committed after its outputs.
"""

from __future__ import annotations

import pytest
from support import messages as samples

from consumers.trainer.positions import (
    OffsetLossError,
    assign_and_position,
    assigned_source,
)
from producers.epoch_gate import EpochGate, first_load_epoch
from schemas import decode
from stream_rl.transport import memory
from stream_rl.transport.client import Transport


@pytest.fixture
def bus_transport(tmp_path, run_name):
    """``transport(partitions)``: a Transport on a fresh in-process bus with the run's topics created."""
    from support.memory_bus import memory_config

    def make(partitions: dict[str, int]) -> Transport:
        cfg = memory_config(run_name, tmp_path / "run", **{"topics.partitions": partitions})
        t = Transport(cfg, "unit")
        t.ensure_topics()
        return t

    yield make
    memory.reset(run_name)


def _fill(t: Transport, topic: str, per_partition: dict[int, list]) -> None:
    sink = t.sink()
    for partition, messages in per_partition.items():
        for msg in messages:
            key = msg.prompt_id if msg.KIND == "prompt" else msg.group_id  # the documented keys
            sink.send(topic, msg, key=key, partition=partition)
    sink.flush()


def _poll_all(source, want: int) -> list:
    got = []
    for _ in range(20):  # a bus poll returns whatever is there at once: a handful of polls is plenty
        got += source.poll(0.01)
        if len(got) >= want:
            break
    return got


# -- the trainer's positioner --------------------------------------------------------------------------------------

def test_the_trainer_reads_each_partition_from_its_checkpoint_offset_else_from_the_start(bus_transport):
    t = bus_transport({"scored": 2})
    _fill(t, t.names.scored, {0: [samples.scored(i) for i in range(4)], 1: [samples.scored(10 + i) for i in range(3)]})
    sink = t.sink()
    source = assigned_source(t, "g-trainer", "scored_rollout", sink)
    reader = t.reader()
    start = assign_and_position(source, reader, t.names.scored, {(t.names.scored, 0): 3}, accept_loss=False)
    assert start == {(t.names.scored, 0): 3, (t.names.scored, 1): 0}
    assert source.assignment() == {(t.names.scored, 0), (t.names.scored, 1)}
    got = _poll_all(source, 4)
    assert sorted((c.partition, c.offset) for c in got) == [(0, 3), (1, 0), (1, 1), (1, 2)]
    assert source.commit()  # assigned, no group membership: the commit is accepted (generation -1)
    assert source.committed(t.names.scored, 1) == 3
    source.close()


def test_the_trainer_refuses_a_checkpoint_offset_past_the_log_unless_the_loss_is_accepted(bus_transport):
    t = bus_transport({"scored": 1})
    _fill(t, t.names.scored, {0: [samples.scored(i) for i in range(2)]})
    source = assigned_source(t, "g-trainer", "scored_rollout", t.sink())
    reader = t.reader()
    checkpoint = {(t.names.scored, 0): 7}  # the topic was re-created: only 2 records now
    with pytest.raises(OffsetLossError, match=r"checkpoint offset 7 .*outside the broker's range \[0, 2\)"):
        assign_and_position(source, reader, t.names.scored, checkpoint, accept_loss=False)
    assert assign_and_position(source, reader, t.names.scored, checkpoint, accept_loss=True) == {
        (t.names.scored, 0): 0}
    assert [c.offset for c in _poll_all(source, 2)] == [0, 1]
    source.close()


# -- the producer's epoch gate -------------------------------------------------------------------------------------

def _gate(t: Transport, source, clock):
    reader = t.reader()
    return EpochGate(source, lambda: reader.partitions(t.names.prompts),
                     first_load_epoch(reader, lambda raw: decode(raw, "prompt")), check_every_s=1.0, clock=clock)


def test_the_epoch_gate_holds_a_partition_at_the_next_epoch_until_every_partition_is_past_it(bus_transport):
    t = bus_transport({"prompts": 2})
    p = samples.prompt
    _fill(t, t.names.prompts, {0: [p(0), p(1, epoch=1), p(0, epoch=1)], 1: [p(2), p(3), p(2, epoch=1)]})
    source = t.source([t.names.prompts], "g-producers", "prompt", t.sink())
    now = [0.0]
    gate = _gate(t, source, lambda: now[0])
    source.holds = gate.held

    first = gate.admit(source.poll(0.01, max_records=2))  # partition 0: an epoch-0 prompt, then epoch 1
    assert [(r.partition, r.offset) for r in first] == [(0, 0)]
    assert gate.held[(t.names.prompts, 0)].offset == 1 and gate.open_epoch == 0
    assert source.position(t.names.prompts, 0) == 1  # sought back to the held record

    now[0] += 2  # partition 1 still has epoch-0 prompts to read: the epoch stays closed
    second = gate.admit(source.poll(0.01, max_records=2))
    assert [(r.partition, r.offset) for r in second] == [(1, 0), (1, 1)]  # partition 0 is paused meanwhile
    assert (t.names.prompts, 0) in gate.held and gate.open_epoch == 0

    third = gate.admit(source.poll(0.01, max_records=2))  # partition 1 reaches epoch 1: every partition is past 0
    assert third == [] and gate.open_epoch == 1 and gate.held == {} and gate.holds == 2
    fourth = gate.admit(_poll_all(source, 3))  # released from the held records themselves
    assert sorted((r.partition, r.offset, r.value.epoch) for r in fourth) == [(0, 1, 1), (0, 2, 1), (1, 2, 1)]
    source.close()


def test_the_epoch_gate_counts_another_producers_partition_from_its_committed_offset(bus_transport):
    t = bus_transport({"prompts": 2})
    p = samples.prompt
    _fill(t, t.names.prompts, {0: [p(0), p(1, epoch=1)], 1: [p(2), p(2, epoch=1)]})
    mine = t.source([t.names.prompts], "g-producers", "prompt", t.sink())
    other = t.source([t.names.prompts], "g-producers", "prompt", t.sink())
    other.poll(0.01)  # the group settles: one partition each (the other producer reads, commits nothing yet)
    now = [0.0]
    gate = _gate(t, mine, lambda: now[0])
    mine.holds = gate.held
    assert [r.value.epoch for r in gate.admit(mine.poll(0.01))] == [0]  # epoch 0 taken, held at epoch 1
    (own,), (theirs,) = mine.assignment(), other.assignment()
    assert own != theirs and own in gate.held
    now[0] += 2
    gate.tick()
    assert own in gate.held and gate.open_epoch == 0  # the other partition's epoch-0 prompt is not committed
    assert other.commit({theirs: 1})  # the other producer took it
    now[0] += 2
    gate.tick()
    assert gate.held == {} and gate.open_epoch == 1
    other.close()
    mine.close()


# -- the group-less reader -----------------------------------------------------------------------------------------

def test_the_reader_lists_measures_and_reads_ranges_in_plain_pairs_and_transport_records(bus_transport):
    from stream_rl.transport.reader import Record

    t = bus_transport({"prompts": 2})
    topic = t.names.prompts
    sink = t.sink()
    for i in range(5):
        sink.send_raw(topic, b"v%d" % i, key=b"k%d" % i, headers=[("h", b"%d" % i)], partition=i % 2)
    sink.flush()
    with t.reader() as reader:
        assert topic in reader.topics()
        parts = reader.partitions(topic)
        assert parts == [(topic, 0), (topic, 1)]
        with pytest.raises(KeyError, match=f"topic {topic}.nope does not exist"):
            reader.partitions(f"{topic}.nope", timeout_s=0)
        assert reader.highwaters(parts) == {(topic, 0): 3, (topic, 1): 2}
        assert reader.highwaters(parts, start={(topic, 0): 3}) == {(topic, 0): 3, (topic, 1): 2}
        records = list(reader.read_range((topic, 0), 1, None))
        assert all(type(r) is Record for r in records)
        assert [(r.topic, r.partition, r.offset, r.key, r.value) for r in records] == [
            (topic, 0, 1, b"k2", b"v2"), (topic, 0, 2, b"k4", b"v4")]
        assert dict(records[0].headers)["h"] == b"2" and records[0].timestamp_ms > 0
        assert [r.offset for r in reader.read_range((topic, 1), 0, 1)] == [0]  # at most ``limit`` records
        assert list(reader.read_range((topic, 1), 2, None)) == []  # from the end: nothing


def test_the_reader_follows_partitions_from_given_offsets(bus_transport):
    t = bus_transport({"prompts": 2})
    topic = t.names.prompts
    sink = t.sink()
    for i in range(4):
        sink.send_raw(topic, b"v%d" % i, key=b"k", partition=i % 2)
    sink.flush()
    with t.reader() as reader:
        reader.follow({(topic, 0): None, (topic, 1): 1})  # None: from the first record
        got = reader.poll(0.01)
        assert sorted((r.partition, r.offset, r.value) for r in got) == [(0, 0, b"v0"), (0, 1, b"v2"), (1, 1, b"v3")]
        assert (reader.position(topic, 0), reader.highwater(topic, 0)) == (2, 2)
        sink.send_raw(topic, b"v4", key=b"k", partition=1)
        sink.flush()
        assert [(r.partition, r.offset, r.value) for r in reader.poll(0.01)] == [(1, 2, b"v4")]
        assert reader.poll(0.0) == []


# -- the scorer's batching -----------------------------------------------------------------------------------------

def test_the_scorer_scores_in_batches_of_batch_size_and_commits_each(bus_transport):
    from support.messages import rollout_for_scoring

    from consumers.scorer.config import ScorerConfig
    from consumers.scorer.scorer import ScorerDeps, run_scorer, scorer_group
    from stream_rl.transport.tracing import Tracing

    t = bus_transport({"rollouts": 1, "scored": 1})
    sink = t.sink()
    rollouts = [rollout_for_scoring(i, s) for i in range(3) for s in range(4)]  # 12 rollouts, 3 groups of 4
    for r in rollouts:
        sink.send(t.names.rollouts, r, key=r.group_id)
    sink.flush()
    cfg = t.cfg.model_copy(update={"scorer": ScorerConfig(
        reward_fn="consumers.scorer.builtin_rewards:exact_match", batch_size=5, poll_timeout_s=0.01)})
    stats = run_scorer(cfg, cfg.scorer, max_batches=3, deps=ScorerDeps(tracing=Tracing("scorer-unit")))
    assert (stats.batches, stats.scored, stats.rejected, stats.commits) == (3, 12, 0, 3)  # 5 + 5 + 2
    with t.reader() as reader:
        scored = [decode(r.value, "scored_rollout") for r in reader.read_range((t.names.scored, 0), 0, None)]
    assert sorted(s.rollout.rollout_id for s in scored) == sorted(r.rollout_id for r in rollouts)
    admin = t.admin()
    try:
        assert admin.committed_offsets(scorer_group(cfg)) == {(t.names.rollouts, 0): 12}
    finally:
        admin.close()
