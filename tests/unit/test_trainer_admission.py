"""The trainer's admission and group bookkeeping without a broker: records refused at admission name their field,
dead-lettered members drop their group, rejected groups are remembered up to a bound, skipped steps requeue, requeues
stop at max_requeues and are not sent twice, and a checkpoint offset outside the broker's range is an error."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from support.trainer import TOPIC, Rec, rec, scored

from consumers.trainer.admit import ModelLimits, check_scored
from consumers.trainer.batcher import Batcher
from consumers.trainer.config import TrainerConfig
from consumers.trainer.history import log_requeues, read_requeues
from consumers.trainer.positions import OffsetLossError, check_offset
from schemas import rollout_id_for

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------ pure: admission
def test_admission_names_the_field_for_token_ids_lengths_and_float32_overflow():
    from transformers import LlamaConfig

    limits = ModelLimits(vocab_size=16, max_positions=64, max_response=8)
    assert check_scored(scored(0, 0, prompt_ids=(0, 15), response_ids=(15, 2)), limits) is None
    bad = check_scored(scored(0, 0, response_ids=(6, 16, 16)), limits)
    assert bad.error_type == "AdmissionError"
    assert bad.reason.startswith("rollout.response_token_ids[1] = 16 is outside the policy's vocabulary [0, 16)")
    assert "2 such token(s)" in bad.reason
    bad = check_scored(scored(0, 0, prompt_ids=(3, 2**31 - 1)), limits)
    assert bad.reason.startswith(f"rollout.prompt_token_ids[1] = {2**31 - 1} is outside")
    negative = scored(0, 0)
    negative.rollout.response_token_ids[0] = -1  # past schema validation: the check is the trainer's own
    assert "response_token_ids[0] = -1" in check_scored(negative, limits).reason
    bad = check_scored(scored(0, 0, prompt_ids=(3,) * 60, response_ids=(4,) * 5), limits)
    assert "60 prompt + 5 response tokens = 65, more than the policy's context max_position_embeddings = 64" \
        in bad.reason
    assert "more than trainer.loss.max_len = 8" in check_scored(scored(0, 0, response_ids=(4,) * 9), limits).reason
    assert "reward = 1e+300 is not finite in float32" in check_scored(scored(0, 0, reward=1e300), limits).reason
    assert check_scored(scored(0, 0, reward=3e38), limits) is None  # fits float32

    model = LlamaConfig(vocab_size=40, max_position_embeddings=128)
    dr_grpo = TrainerConfig(loss={"agg": "seq-mean-token-sum-norm", "max_len": 20})
    assert ModelLimits.of(model, dr_grpo) == ModelLimits(40, 128, 20)
    assert ModelLimits.of(model, TrainerConfig(loss={"max_len": 20})) == ModelLimits(40, 128, None)  # token-mean


# ------------------------------------------------------------------------------------------------ pure: batcher
def test_a_dead_lettered_member_drops_its_group_at_once_and_frees_the_safe_offset():
    b = Batcher(max_lag=2)
    b.add(rec(0, 0, 0, group_size=3), 0)
    b.add(rec(1, 1, 0), 0)  # another group, buffered: its offset stays held
    (drop,) = b.reject(rec(2, 0, 1, group_size=3), 0, "rollout.response_token_ids[0] = 99 is outside ...")
    assert [s.rollout_id for s in drop.stale] == [rollout_id_for("p0", 0, 0)]  # the buffered member; not the reject
    assert drop.stale[0].requeued and "member p0:0:1 was dead-lettered: rollout.response_token_ids" in drop.reason
    assert (drop.requeue.prompt_id, drop.requeue.attempt) == ("p0", 1)
    assert b.safe_offsets() == {(TOPIC, 0): 1}  # offset 0 no longer pinned; p1 (offset 1) still is
    (late,) = b.add(rec(3, 0, 2, group_size=3), 0)  # a later member of the dropped attempt
    assert late.requeue is None and "superseded" in late.stale[0].reason
    assert b.reject(rec(4, 0, 0, group_size=3), 0, "again") == []  # same attempt: nothing more
    (first,) = b.reject(rec(5, 2, 0), 0, "bad")  # the group's first member: re-queued with nothing buffered
    assert first.stale == [] and first.requeue.prompt_id == "p2"
    assert b.counters["rejected"] == 3 and b.counters["requeued"] == 2 and b.buffered_groups == 1


def test_a_member_dead_lettered_upstream_drops_its_group_at_once_or_when_its_first_member_arrives():
    """A scorer's MemberRejected (or the trainer's own edge) names a group whose member never arrives."""
    b = Batcher(max_lag=2)
    b.add(rec(0, 0, 0, group_size=3), 0)
    notice = Rec(TOPIC, 0, 1, None)  # the notice's own record: its offset counts as seen
    (drop,) = b.reject_member("p0:0", 0, "p0:0:1 by scorer-1 (ValueError): token id 99", 0, at=notice)
    assert [s.rollout_id for s in drop.stale] == [rollout_id_for("p0", 0, 0)] and drop.stale[0].requeued
    assert "a member was dead-lettered: p0:0:1 by scorer-1" in drop.reason and drop.requeue.attempt == 1
    assert b.safe_offsets() == {(TOPIC, 0): 2} and b.buffered_groups == 0
    assert b.reject_member("p0:0", 0, "again", 0) == []  # a repeated notice (a scorer re-ran): nothing more
    assert b.reject_member("p0:0", None, "undecodable, keyed p0:0", 0) == []  # attempt unknown, group dropped
    # rejected before any member arrived: the first member of that attempt drops it, with nothing to wait for
    assert b.reject_member("p1:0", 1, "bad", 0) == []
    assert b.add(rec(2, 1, 0), 0) == []  # attempt 0 is not the rejected one: it is kept
    (late,) = b.add(rec(3, 1, 1, attempt=1), 0)
    assert [s.rollout_id for s in late.stale] == [rollout_id_for("p1", 0, 0), rollout_id_for("p1", 0, 1)]
    assert late.requeue.attempt == 2  # the group's highest attempt + 1
    # attempt unknown (an undecodable record keyed by its group id): the next member to arrive drops it
    assert b.reject_member("p2:0", None, "not msgpack", 0) == []
    (undecoded,) = b.add(rec(4, 2, 1), 0)
    assert "a member was dead-lettered: not msgpack" in undecoded.reason and undecoded.requeue.attempt == 1
    assert b.add(rec(5, 2, 0, attempt=1), 0) == []  # the regenerated attempt is unaffected
    # a group already trained, or already whole, is never dropped by a late notice
    b.add(rec(6, 3, 0), 0)
    b.add(rec(7, 3, 1), 0)
    assert b.reject_member("p3:0", 0, "late", 0) == [] and b.ready_groups == 1
    b.mark_trained(b.take(1))
    assert b.reject_member("p3:0", None, "later", 0) == [] and b.reject_member("p3:0", 0, "later", 0) == []
    assert b.add(rec(8, 3, 0), 0) == [] and b.counters["duplicates"] == 1


def test_groups_rejected_before_any_member_arrived_are_remembered_up_to_a_bound(monkeypatch):
    import consumers.trainer.batcher as batcher_mod

    monkeypatch.setattr(batcher_mod, "MAX_DOOMED", 2)
    b = Batcher(max_lag=2)
    for p in range(3):
        b.reject_member(f"p{p}:0", 0, "bad", 0)
    assert b.add(rec(0, 0, 0), 0) == []  # the oldest was forgotten: p0 only waits to go stale
    assert len(b.add(rec(1, 1, 0), 0)) == 1 and len(b.add(rec(2, 2, 0), 0)) == 1
    b.see(Rec(TOPIC, 1, 7, None))  # a record the edge dead-lettered that names no group: passed, never held
    assert b.safe_offsets() == {(TOPIC, 0): 0, (TOPIC, 1): 8}


def test_groups_of_a_skipped_step_are_not_trained_and_are_requeued():
    b = Batcher(max_lag=2)
    for off, (p, s) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        b.add(rec(off, p, s), 0)
    groups = b.take(2)
    drops = b.drop_skipped(groups, 0, "step 1: update skipped: non-finite loss nan")
    assert b.ledger.groups() == set() and b.safe_offsets() == {(TOPIC, 0): 4}
    assert [d.requeue.prompt_id for d in drops] == ["p0", "p1"]
    assert all(s.requeued and s.reason.startswith("step 1: update skipped") for d in drops for s in d.stale)
    assert b.counters["skipped"] == 4 and b.counters["trained"] == 0
    for off, s in enumerate(range(2), start=4):  # the regenerated attempt is accepted and trainable
        assert b.add(rec(off, 0, s, attempt=1), 0) == []
    assert b.ready_groups == 1


def test_requeues_stop_at_max_requeues_and_say_so():
    b = Batcher(max_lag=0, max_requeues=1)
    (drop,) = b.add(rec(0, 0, 0, version=0), 1)
    assert drop.requeue.attempt == 1
    (last,) = b.add(rec(1, 0, 0, version=0, attempt=1), 1)
    assert last.requeue is None and not last.stale[0].requeued
    assert "not re-queued: attempt 1 is the last (max_requeues 1)" in last.stale[0].reason
    assert b.counters["not_requeued"] == 1


def test_requeues_logged_by_a_previous_process_are_not_sent_again(tmp_path):
    log_path = tmp_path / "requeued.jsonl"
    first = Batcher(max_lag=0)
    (drop,) = first.add(rec(2, 1, 0, version=0), 1)  # stale after the checkpoint: re-queued, then a crash
    log_requeues(log_path, "stream-rl.t.prompts", [drop.requeue])
    log_requeues(log_path, "stream-rl.other.prompts", [replace(drop.requeue, prompt_id="p7", attempt=3)])
    with open(log_path, "a") as fh:
        fh.write('{"group_id": "torn')  # a torn last line is skipped
    assert read_requeues(log_path, "stream-rl.t.prompts") == {drop.requeue.group_id: 1}  # this run's only
    resumed = Batcher.from_state(0, Batcher(max_lag=0).ledger_state())  # the checkpoint predates the drop
    for group_id, attempt in read_requeues(log_path, "stream-rl.t.prompts").items():
        resumed.note_requeued(group_id, attempt - 1)
    (again,) = resumed.add(rec(2, 1, 0, version=0), 1)
    assert again.requeue is None and "superseded" in again.stale[0].reason
    assert resumed.add(rec(3, 1, 0, version=1, attempt=1), 1) == []  # the re-queued attempt is trainable


def test_a_checkpoint_offset_outside_the_broker_range_is_an_error_unless_accepted(caplog):
    key = ("stream-rl.r.scored", 2)
    assert check_offset(key, 5, 0, 5, accept_loss=False) == 5  # caught up: fine
    with pytest.raises(OffsetLossError) as err:
        check_offset(key, 192, 0, 40, accept_loss=False)
    assert "checkpoint offset 192 of stream-rl.r.scored[2] is outside the broker's range [0, 40)" in str(err.value)
    with pytest.raises(OffsetLossError, match=r"offset 3 .* range \[10, 40\) \(before the start"):
        check_offset(key, 3, 10, 40, accept_loss=False)
    with caplog.at_level(logging.WARNING):
        assert check_offset(key, 192, 7, 40, accept_loss=True) == 7
    assert "checkpoint offset 192 of stream-rl.r.scored[2] is outside the broker's range [7, 40)" in caplog.text
