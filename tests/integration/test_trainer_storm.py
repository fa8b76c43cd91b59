"""Trainer defects found by the kill -9 / fuzz storm (issue 17 items 1, 2, 4, 6, 9 on the trainer side, issue 12's
"a dead-lettered member must not pin its partition"): each reproduced first, pure where the logic is pure, through
the real broker and the trainer loop where the defect lives there."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.topics import committed, read_values
from support.trainer import TOPIC, Rec, rec, scored
from support.trainer_loop import finish, metric_rows, start
from support.waiting import wait_for

from consumers.trainer.admit import ModelLimits, check_scored
from consumers.trainer.batcher import Batcher
from consumers.trainer.config import TrainerConfig
from consumers.trainer.history import log_requeues, read_requeues
from consumers.trainer.ledger import Ledger, split_rollout_id
from consumers.trainer.positions import OffsetLossError, check_offset
from consumers.trainer.trainer import trainer_group
from schemas import MemberRejected, rollout_id_for
from stream_rl.storage.checkpoint import latest_checkpoint, load_checkpoint
from stream_rl.transport.client import Transport

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


# ------------------------------------------------------------------------------------------------ through the broker
def storm_config(make_config, model_dir, **extra):
    base = {"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 1, "trainer.micro_batch_size": 2,
            "trainer.poll_timeout_s": 0.2, "trainer.lr": 1e-3, "topics.partitions.scored": 1}
    base.update(extra)
    return make_config(**base)


def send(transport, sink, records) -> None:
    for r in records:
        sink.send(transport.names.scored, r, key=r.group_id)
    sink.flush()


def group(p: int, version: int = 0, **kw) -> list:
    return [scored(p, s, version=version, reward=float(s == 0), response_ids=[6 + s, 7], **kw) for s in range(2)]


def trained_lines(cfg) -> list[dict]:
    path = Path(cfg.run_dir) / "trained.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.broker
def test_a_skipped_update_trains_nothing_and_requeues_its_groups(make_config, model_dir):
    """17.1: rewards 3e38 + 3e38 overflow the group mean (float32): NaN advantages, NaN loss, update skipped; the
    default stop alert ends the trainer after its final checkpoint, and the resume trains on from there."""
    from stream_rl.alerts.monitor import AlertStop

    cfg = storm_config(make_config, model_dir, **{"trainer.max_steps": 3, "trainer.checkpoint_every": 1})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    poison = [replace(r, reward=3e38) for r in group(1)]
    send(transport, sink, [*group(0), *poison, *group(2)])
    thread, stop, result, errors = start(cfg)
    thread.join(60)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], AlertStop), errors
    skipped_ids = [rollout_id_for("p1", 0, s) for s in range(2)]
    ckpt = load_checkpoint(latest_checkpoint(Path(cfg.run_dir) / "checkpoints"))
    assert ckpt.step == 2 and not {split_rollout_id(r) for r in skipped_ids} & Ledger.from_json(
        ckpt.ledger["groups"]).groups()
    assert ckpt.offsets == {(transport.names.scored, 0): 4}  # p1 is settled (stale, re-queued), not trained
    stale = read_values(transport, transport.names.stale, "stale_rollout")
    assert sorted(s.rollout_id for s in stale) == skipped_ids
    assert all(s.requeued and "step 2: update skipped: non-finite loss nan" in s.reason for s in stale)
    prompts = read_values(transport, transport.names.prompts, "prompt")
    assert [(p.prompt_id, p.attempt) for p in prompts] == [("p1", 1)]

    state = finish(*start(cfg, resume=True))
    assert state.step == 3
    lines = trained_lines(cfg)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[1]["rollout_ids"] == [] and lines[1]["skipped_ids"] == skipped_ids
    assert lines[1]["skipped"].startswith("step 2: update skipped: non-finite loss")
    assert lines[2]["rollout_ids"] == [rollout_id_for("p2", 0, s) for s in range(2)]
    rows = metric_rows(cfg)
    assert len(rows) == 3 and rows[1]["optim/skipped_updates"] == 1.0 and rows[1]["loss/total"] is None
    assert rows[2]["batcher/skipped_total"] == 2.0
    sink.close()


@pytest.mark.broker
def test_records_the_model_cannot_take_are_dead_lettered_and_their_groups_do_not_pin(make_config, model_dir):
    """17.4 (trainer side) and issue 12: a token id = vocabulary size, a 2^31-1 prompt token, a response beyond
    the context: each dead-lettered with the reason, its group dropped at once, the role trains on."""
    cfg = storm_config(make_config, model_dir, **{"trainer.max_steps": 2, "trainer.checkpoint_every": 100})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    vocab = 16  # tiny_policy's vocabulary
    too_long = list(range(3, 15)) * 6  # 72 tokens + 3 prompt tokens > max_position_embeddings 64
    send(transport, sink, [
        group(0)[0], scored(0, 1, response_ids=[6, vocab]),  # offsets 0, 1: p0's second member is out of vocab
        *group(1),  # 2, 3: trained at step 1
        scored(2, 0, prompt_ids=[3, 2**31 - 1]), group(2)[1],  # 4, 5: p2 rejected first, its sibling superseded
        scored(3, 0, response_ids=too_long), *group(4)])  # 6: rejected; 7, 8: p4 trained at step 2
    finish(*start(cfg))

    letters = read_values(transport, transport.names.dlq, "dead_letter")
    assert [(d.source_offset, d.error_type) for d in letters] == [(1, "AdmissionError"), (4, "AdmissionError"),
                                                                  (6, "AdmissionError")]
    assert "response_token_ids[1] = 16 is outside the policy's vocabulary [0, 16)" in letters[0].reason
    assert f"prompt_token_ids[1] = {2**31 - 1}" in letters[1].reason
    assert "3 prompt + 72 response tokens = 75" in letters[2].reason
    stale = read_values(transport, transport.names.stale, "stale_rollout")
    assert [(s.rollout_id, s.requeued) for s in stale] == [(rollout_id_for("p0", 0, 0), True),
                                                           (rollout_id_for("p2", 0, 1), False)]
    assert "was dead-lettered: rollout.response_token_ids[1] = 16" in stale[0].reason
    prompts = read_values(transport, transport.names.prompts, "prompt")
    assert sorted((p.prompt_id, p.attempt) for p in prompts) == [("p0", 1), ("p2", 1), ("p3", 1)]
    ckpt = load_checkpoint(latest_checkpoint(Path(cfg.run_dir) / "checkpoints"))
    assert ckpt.offsets == {(transport.names.scored, 0): 9}  # nothing pinned by the dropped groups
    assert [line["rollout_ids"] for line in trained_lines(cfg)] == [
        [rollout_id_for("p1", 0, s) for s in range(2)], [rollout_id_for("p4", 0, s) for s in range(2)]]
    sink.close()


def _notice(group_id: str, offset: int, rollout_id: str | None = None) -> MemberRejected:
    return MemberRejected(group_id=group_id, rollout_id=rollout_id, attempt=None if rollout_id is None else 0,
                          reason="reference model cannot score this rollout", error_type="ValueError",
                          source_topic="stream-rl.t.rollouts", source_partition=0, source_offset=offset,
                          consumer_id="scorer-1")


@pytest.mark.broker
def test_groups_whose_members_were_dead_lettered_upstream_are_dropped_at_once_and_pin_nothing(make_config,
                                                                                              model_dir):
    """Issue 12: a scorer's MemberRejected and a record the trainer's edge cannot decode (keyed by its group)
    drop the group at once; without that, the first one would pin offset 0 until it went stale, and the
    checkpoint after the one trainable group would stay there."""
    cfg = storm_config(make_config, model_dir, **{"trainer.max_steps": 1, "trainer.checkpoint_every": 100})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    send(transport, sink, [group(5)[0], _notice("p5:0", 11, rollout_id_for("p5", 0, 1)),  # 0, 1: p5 dropped
                           _notice("p6:0", 12), *group(6)])  # 2: before any member; 3: p6 dropped, 4: superseded
    sink.send_raw(transport.names.scored, b"\xc1 not msgpack", key=b"p7:0")  # 5: the edge dead-letters it
    send(transport, sink, [group(7)[1], *group(1)])  # 6: p7 dropped; 7, 8: p1 trained at step 1
    finish(*start(cfg))

    stale = read_values(transport, transport.names.stale, "stale_rollout")
    assert [(s.rollout_id, s.requeued) for s in stale] == [
        (rollout_id_for("p5", 0, 0), True), (rollout_id_for("p6", 0, 0), True), (rollout_id_for("p6", 0, 1), False),
        (rollout_id_for("p7", 0, 1), True)]
    assert "a member was dead-lettered: p5:0:1 by scorer-1 (ValueError): reference model" in stale[0].reason
    assert "a member was dead-lettered: a rollout by scorer-1" in stale[1].reason
    assert "a member was dead-lettered: invalid message: not valid msgpack" in stale[3].reason
    prompts = read_values(transport, transport.names.prompts, "prompt")
    assert sorted((p.prompt_id, p.attempt) for p in prompts) == [("p5", 1), ("p6", 1), ("p7", 1)]
    assert [(d.source_offset, d.error_type) for d in read_values(transport, transport.names.dlq, "dead_letter")] \
        == [(5, "SchemaError")]
    assert [line["rollout_ids"] for line in trained_lines(cfg)] == [[rollout_id_for("p1", 0, s) for s in range(2)]]
    ckpt = load_checkpoint(latest_checkpoint(Path(cfg.run_dir) / "checkpoints"))
    assert ckpt.offsets == {(transport.names.scored, 0): 9}  # nothing pinned by the dropped groups
    sink.close()


def _recreate_scored(transport) -> None:
    admin = transport.admin()
    try:
        admin.delete_topics([transport.names.scored])
        wait_for(lambda: transport.names.scored not in admin.list_topics(), "the scored topic deleted", 20)
    finally:
        admin.close()
    transport.ensure_topics()


@pytest.mark.broker
def test_a_resume_past_the_end_of_a_partition_stops_unless_the_loss_is_accepted(make_config, model_dir):
    """17.2: the topic was re-created with fewer records than the checkpoint's offset."""
    cfg = storm_config(make_config, model_dir, **{"trainer.max_steps": 2, "trainer.checkpoint_every": 1})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    send(transport, sink, [*group(0), *group(1)])
    finish(*start(cfg))  # checkpoint at step 2, offset 4
    sink.close()
    _recreate_scored(transport)
    sink = transport.sink()  # a new producer: the old one's idempotence state belongs to the deleted partition
    send(transport, sink, group(2))  # the new topic holds offsets [0, 2)
    resumed = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"max_steps": 3})})
    thread, stop, result, errors = start(resumed, resume=True)
    thread.join(60)
    if thread.is_alive():
        stop.set()
        thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], OffsetLossError), errors
    assert f"checkpoint offset 4 of {transport.names.scored}[0] is outside the broker's range [0, 2)" \
        in str(errors[0])
    assert len(metric_rows(cfg)) == 2

    accept = resumed.model_copy(update={"trainer": resumed.trainer.model_copy(update={"accept_offset_loss": True})})
    state = finish(*start(accept, resume=True))
    assert state.step == 3 and trained_lines(cfg)[-1]["rollout_ids"] == [rollout_id_for("p2", 0, s) for s in range(2)]
    assert load_checkpoint(latest_checkpoint(Path(cfg.run_dir) / "checkpoints")).offsets == \
        {(transport.names.scored, 0): 2}
    sink.close()


MEMBER = """
import signal, sys
from kafka import KafkaConsumer
bootstrap, topic, group, session, heartbeat = sys.argv[1:6]
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))  # as every role does: a clean close on SIGTERM
c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                  session_timeout_ms=int(session), heartbeat_interval_ms=int(heartbeat))
c.subscribe([topic])
print("joining", flush=True)
while not stop:
    c.poll(200)
c.close(autocommit=False)
"""


@pytest.mark.broker
def test_a_member_stopped_during_its_first_join_does_not_stall_the_trainer(make_config, model_dir):
    """17.6: a trainer-group member SIGTERMed during its first join leaves the group unjoinable on tansu 0.6 (a
    subscriber gets no partition for minutes); the trainer assigns its partitions and trains at once."""
    cfg = storm_config(make_config, model_dir, **{"trainer.max_steps": 1, "topics.partitions.scored": 2})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    member = subprocess.Popen(
        [sys.executable, "-c", MEMBER, transport.bootstrap, transport.names.scored, trainer_group(cfg),
         str(cfg.kafka.session_timeout_ms), str(cfg.kafka.heartbeat_interval_ms)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert member.stdout.readline().strip() == "joining"
        time.sleep(0.5)  # inside the join, which tansu holds for session_timeout / 2
    finally:
        member.send_signal(signal.SIGTERM)
        member.wait(20)
    send(transport, sink, group(0))
    began = time.monotonic()
    state = finish(*start(cfg), timeout_s=25)  # a subscribing trainer would still be waiting for its partitions
    assert state.step == 1 and time.monotonic() - began < 25
    ckpt = load_checkpoint(latest_checkpoint(Path(cfg.run_dir) / "checkpoints"))
    assert committed(transport, trainer_group(cfg)) == ckpt.offsets  # commits work without group membership
    assert set(ckpt.offsets) == {(transport.names.scored, 0), (transport.names.scored, 1)}
    sink.close()


@pytest.mark.broker
def test_a_resume_does_not_requeue_a_prompt_it_already_requeued(make_config, model_dir):
    """17.9: a group dropped as stale after the last checkpoint is re-read by every resume; its prompt is
    re-queued once in all."""
    cfg = storm_config(make_config, model_dir, **{"trainer.max_lag": 0, "trainer.checkpoint_every": 1})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()

    def stale_count() -> int:
        return len(read_values(transport, transport.names.stale, "stale_rollout"))

    send(transport, sink, group(0))  # step 1 at version 0, checkpoint (offset 2), version 1 published
    for resume, expected_stale in ((False, 2), (True, 4), (True, 6)):
        thread, stop, result, errors = start(cfg, resume=resume)
        if not resume:
            wait_for(lambda: len(metric_rows(cfg)) >= 1, "step 1")
            send(transport, sink, group(1, version=0))  # lag 1 > max_lag 0: stale, re-queued (after the checkpoint)
        wait_for(lambda: stale_count() >= expected_stale, f"{expected_stale} stale records", 40)
        stop.set()
        finish(thread, stop, result, errors)  # no step since the checkpoint: no new checkpoint
        assert load_checkpoint(latest_checkpoint(Path(cfg.run_dir) / "checkpoints")).offsets == \
            {(transport.names.scored, 0): 2}
    prompts = read_values(transport, transport.names.prompts, "prompt")
    assert [(p.prompt_id, p.attempt) for p in prompts] == [("p1", 1)]
    stale = read_values(transport, transport.names.stale, "stale_rollout")
    assert [s.requeued for s in stale] == [True, False, False, False, False, False]  # s1 came after the drop
    assert all("superseded" in s.reason for s in stale[1:])
    sink.close()
