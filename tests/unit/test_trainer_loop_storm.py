"""Trainer defects found by the kill -9 / fuzz storm (issue 17 items 1, 2, 4, 9 on the trainer side, issue 12's
"a dead-lettered member must not pin its partition"), through the trainer loop on the in-process bus (``memory://``,
proved equal to the broker by tests/integration/test_edge_contract.py).

Moved from tests/integration/test_trainer_storm.py (same assertions); 17.6, a member stopped during its first join
on the broker, stays there: it is the broker's behaviour."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from support.topics import read_values
from support.storm import group, send, storm_config
from support.trainer import scored
from support.trainer_loop import finish, metric_rows, start
from support.waiting import wait_for

from consumers.trainer.ledger import Ledger, split_rollout_id
from consumers.trainer.positions import OffsetLossError
from schemas import MemberRejected, rollout_id_for
from stream_rl.storage.checkpoint import latest_checkpoint, load_checkpoint
from stream_rl.transport.client import Transport

torch.set_num_threads(1)


def trained_lines(cfg) -> list[dict]:
    path = Path(cfg.run_dir) / "trained.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


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
