"""The trainer's batcher: whole groups, dedup by rollout id, staleness with re-queue, safe offsets (pure)."""

from __future__ import annotations

import numpy as np
import pytest
from support.trainer import TOPIC, rec, scored

from consumers.trainer.batcher import Batcher
from schemas import group_id_for, validate


def test_a_group_is_ready_only_when_every_member_arrived():
    b = Batcher(max_lag=2)
    assert b.add(rec(0, 0, 0, group_size=3), 0) == []
    assert b.add(rec(1, 1, 0, group_size=2), 0) == []
    assert b.add(rec(2, 0, 1, group_size=3), 0) == []
    assert b.take(1) is None
    b.add(rec(3, 1, 1, group_size=2), 0)
    (first,) = b.take(1)
    assert first.group_id == group_id_for("p1", 0) and len(first.records) == 2
    b.add(rec(4, 0, 2, group_size=3), 0)
    (second,) = b.take(1)
    assert [r.value.rollout.sample_index for r in second.records.values()] == [0, 1, 2]


def test_groups_leave_in_arrival_order_and_take_waits_for_n():
    b = Batcher(max_lag=2)
    for off, (p, s) in enumerate([(5, 0), (5, 1), (7, 0), (7, 1)]):
        b.add(rec(off, p, s), 0)
    assert b.take(3) is None
    assert [g.group_id for g in b.take(2)] == [group_id_for("p5", 0), group_id_for("p7", 0)]


def test_duplicates_are_dropped_whether_buffered_or_trained():
    b = Batcher(max_lag=2)
    b.add(rec(0, 0, 0), 0)
    b.add(rec(1, 0, 0), 0)  # redelivered while buffered
    assert b.counters["duplicates"] == 1
    b.add(rec(2, 0, 1), 0)
    groups = b.take(1)
    b.add(rec(3, 0, 1), 0)  # redelivered while in training
    b.mark_trained(groups)
    b.add(rec(4, 0, 0), 0)  # redelivered after training
    assert b.counters["duplicates"] == 3
    assert b.take(1) is None and b.buffered_groups == 0
    assert b.ledger.groups() == {("p0", 0)}


def test_one_stale_member_makes_the_group_stale_and_requeues_its_prompt_once():
    b = Batcher(max_lag=1)
    assert b.add(rec(0, 0, 0, group_size=3, version=5), 5) == []
    (drop,) = b.add(rec(1, 0, 1, group_size=3, version=3, attempt=0), 5)  # lag 2 > 1
    assert [s.rollout_id for s in drop.stale] == [scored(0, 0).rollout_id, scored(0, 1).rollout_id]
    assert [s.lag for s in drop.stale] == [0, 2] and all(s.requeued for s in drop.stale)
    assert all(s.trainer_version == 5 and s.max_lag == 1 for s in drop.stale)
    assert "lag 2 > max_lag 1" in drop.stale[0].reason
    for s in drop.stale:
        validate(s)
    p = drop.requeue
    assert (p.prompt_id, p.epoch, p.attempt, p.group_size, p.text, p.answer, p.metadata) == \
        ("p0", 0, 1, 3, "0+1=", "1", {"task": "t"})
    validate(p)
    (late,) = b.add(rec(2, 0, 2, group_size=3, version=5, attempt=0), 5)  # late member of the dropped attempt
    assert late.requeue is None and not late.stale[0].requeued and "superseded" in late.stale[0].reason
    assert b.counters["requeued"] == 1 and b.buffered_groups == 0
    # the regenerated group (attempt 1, same deterministic ids) is accepted, not taken for duplicates
    for off, s in enumerate(range(3), start=3):
        assert b.add(rec(off, 0, s, group_size=3, version=5, attempt=1), 5) == []
    assert len(b.take(1)[0].records) == 3


def test_expire_drops_waiting_groups_that_aged_past_max_lag():
    b = Batcher(max_lag=1)
    b.add(rec(0, 0, 0, version=0), 0)
    b.add(rec(1, 0, 1, version=0), 0)  # complete, ready
    b.add(rec(2, 1, 0, version=1), 1)  # incomplete
    assert b.expire(1) == []
    drops = b.expire(2)
    assert [d.requeue.prompt_id for d in drops] == ["p0"]
    assert b.ready_groups == 0 and b.buffered_groups == 1


def test_a_rollout_from_a_version_newer_than_the_trainer_is_stale_with_lag_zero():
    b = Batcher(max_lag=4)
    (drop,) = b.add(rec(0, 0, 0, versions=[2, 3]), 1)
    assert drop.stale[0].lag == 0 and "version 3 > trainer version 1" in drop.stale[0].reason
    assert drop.requeue.attempt == 1


def test_safe_offsets_stop_at_the_oldest_held_record_per_partition():
    b = Batcher(max_lag=1)
    b.add(rec(10, 0, 0, partition=0), 0)
    b.add(rec(11, 1, 0, partition=0), 0)
    b.add(rec(12, 0, 1, partition=0), 0)  # group p0 complete: held (ready)
    b.add(rec(5, 2, 0, partition=1), 0)
    b.add(rec(6, 2, 1, partition=1), 0)
    assert b.safe_offsets() == {(TOPIC, 0): 10, (TOPIC, 1): 5}
    groups = b.take(2)
    assert b.safe_offsets() == {(TOPIC, 0): 10, (TOPIC, 1): 5}  # in training: still held
    b.mark_trained(groups)
    assert b.safe_offsets() == {(TOPIC, 0): 11, (TOPIC, 1): 7}  # p1 (offset 11) still buffered
    b.add(rec(13, 0, 0, partition=0), 0)  # duplicate: passes
    b.add(rec(14, 1, 1, partition=0, version=0), 3)  # stale: drops p1 with offset 11 as well
    assert b.safe_offsets() == {(TOPIC, 0): 15, (TOPIC, 1): 7}
    assert b.position((TOPIC, 0)) == 15 and b.position((TOPIC, 9)) is None


def test_ledger_state_round_trips_without_the_buffers():
    b = Batcher(max_lag=0)
    b.add(rec(0, 0, 0), 0)
    b.add(rec(1, 0, 1), 0)
    b.mark_trained(b.take(1))
    b.add(rec(2, 1, 0, version=0), 1)  # stale: re-queued
    b.add(rec(3, 2, 0, version=1), 1)  # buffered: not part of the ledger
    restored = Batcher.from_state(0, b.ledger_state())
    assert restored.ledger.groups() == b.ledger.groups() == {("p0", 0)}
    assert restored.requeued == {group_id_for("p1", 0): 0}
    assert restored.counters == b.counters
    assert restored.add(rec(3, 2, 0, version=1), 1) == [] and restored.counters["duplicates"] == 0
    assert restored.add(rec(0, 0, 0), 1) == [] and restored.counters["duplicates"] == 1


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        Batcher(max_lag=-1)
    with pytest.raises(ValueError):
        Batcher(max_lag=0).take(0)


def test_a_group_split_across_partitions_is_trained_whole_and_holds_both_partitions():
    """An outside writer with another partitioner put one group's members on two partitions: the group is still
    assembled and trained whole, and neither partition's safe offset passes a member until it is trained."""
    b = Batcher(max_lag=2)
    b.add(rec(5, 0, 0, partition=0), 0)
    assert b.safe_offsets() == {(TOPIC, 0): 5}
    b.add(rec(9, 0, 1, partition=1), 0)
    (group,) = b.take(1)
    assert sorted((r.partition, r.offset) for r in group.records.values()) == [(0, 5), (1, 9)]
    assert b.safe_offsets() == {(TOPIC, 0): 5, (TOPIC, 1): 9}  # in training: both held
    b.mark_trained([group])
    assert b.safe_offsets() == {(TOPIC, 0): 6, (TOPIC, 1): 10} and b.ledger.groups() == {("p0", 0)}


def test_rollout_lag_agrees_with_policy_lag_on_every_shape_of_versions():
    """The per-record fast path is policy_lag's formula for one row whose tokens are all valid."""
    import torch

    from consumers.trainer.batcher import rollout_lag
    from stream_rl.algorithms import policy_lag

    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 8))
        versions = rng.integers(0, 10, n).tolist()
        current = int(rng.integers(max(versions), 14))
        item = scored(0, 0, response_ids=list(range(3, 3 + n)), versions=versions)
        expected = int(policy_lag(torch.tensor([versions]), torch.ones(1, n, dtype=torch.bool), current)[0])
        assert rollout_lag(item, current) == expected == current - min(versions)
    newer = scored(0, 0, response_ids=[3, 4], versions=[5, 7])
    assert rollout_lag(newer, 6) == -1  # from a version the trainer has not made: negative, as before
