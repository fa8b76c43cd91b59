"""Issue 35.2: an output that cannot fit ``kafka.max_request_size`` is dead-lettered with both sizes, its group is
dropped, and the role goes on (before: the scorer crash-looped on ``MessageSizeTooLargeError``).

Each test writes its oversized input with an outside producer whose limit is the default 1 MiB (the broker accepts
it), while the role under test runs with a 64 KiB limit: the consumed record fits, the output built from it does not.
The roles that republish what they consumed are the scorer (the rollout inside its scored record; ``stream-rl
rescore`` runs the same ``score_and_send``) and the producer (the prompt's text and metadata inside each rollout).
The trainer's outputs (stale records, re-queued prompts) are built from, and smaller than, a scored record that
already fitted its limit; its sends go through the same size check in :class:`~stream_rl.transport.sink.Sink`.
"""

from __future__ import annotations

import json
import logging

import dataclasses

import pytest
from support.messages import rollout_for_scoring
from support.producers import FakeEngine, prompt_record, send_prompts, start_producer, stop_producer
from support.scorer import ScorerThread, group_rollouts, send_rollouts
from support.topics import committed, read_records
from support.waiting import wait_for

from consumers.scorer.config import ScorerConfig
from producers.config import ProducerConfig
from schemas import MemberRejected, ScoredRollout, decode, encode, group_id_for
from stream_rl.transport.client import Transport
from stream_rl.transport.sink import RecordTooLarge, record_size

LIMIT = 65_536
BLOB = "x" * 70_000  # fits 1 MiB, not 64 KiB
ONE_PARTITION = {"rollouts": 1, "scored": 1, "dlq": 1, "prompts": 1}


def _configs(make_config):
    """(the role's config: 64 KiB limit, the outside writer's: 1 MiB), same run and topics."""
    role = make_config(**{"kafka.max_request_size": LIMIT, "topics.partitions": ONE_PARTITION})
    outside = make_config(**{"topics.partitions": ONE_PARTITION})
    Transport(outside, "test").ensure_topics()
    return role, outside


@pytest.mark.broker
def test_a_send_over_the_limit_is_refused_before_the_client_with_both_sizes(make_config):
    """A record that fits (its headers included) is sent and acknowledged; one over the limit raises RecordTooLarge
    naming the topic and both sizes (the client's own estimate of it), and nothing is left pending."""
    role, _ = _configs(make_config)
    transport = Transport(role, "test")
    sink = transport.sink()
    try:
        fits = LIMIT - record_size(b"", b"k") - 1_024  # room for a traceparent header
        sink.send_raw(transport.names.dlq, b"v" * fits, key=b"k")
        assert len(sink.flush()) == 1
        size = record_size(b"v" * LIMIT, b"k")  # the headers the send adds come on top
        with pytest.raises(RecordTooLarge, match=f"for {transport.names.dlq} is [0-9]+ bytes serialized, more than "
                                                  f"kafka.max_request_size = {LIMIT} bytes") as refused:
            sink.send_raw(transport.names.dlq, b"v" * LIMIT, key=b"k")
        assert refused.value.size >= size > LIMIT and refused.value.limit == LIMIT
        assert sink.pending == 0
    finally:
        sink.close()


@pytest.mark.broker
def test_scorer_dead_letters_an_output_too_large_drops_its_group_and_goes_on(make_config, caplog):
    caplog.set_level(logging.INFO, logger="consumers.scorer.scorer")
    role, outside = _configs(make_config)
    t = Transport(outside, "test")
    big = rollout_for_scoring(1, 0, metadata={"blob": BLOB})
    good = group_rollouts(0, 1) + [big] + [rollout_for_scoring(1, s) for s in (1, 2, 3)] + group_rollouts(2, 1)
    acks = send_rollouts(t, good)
    big_offset = acks[4].offset
    scorer = ScorerThread(role, ScorerConfig(reward_fn="consumers.scorer.builtin_rewards:exact_match", batch_size=16, poll_timeout_s=0.3))
    group = role.topics.prefix + "." + role.topics.run + ".scorers"
    wait_for(lambda: committed(t, group).get((t.names.rollouts, 0)) == len(good), "the scorer's commit past all 12",
             40, watch=[scorer])
    stats = scorer.finish()
    assert (stats.scored, stats.rejected) == (11, 1)
    letters = [d.value for d in read_records(t, t.names.dlq, "dead_letter")]
    assert [(d.error_type, d.source_offset) for d in letters] == [("RecordTooLarge", big_offset)]
    assert f"more than kafka.max_request_size = {LIMIT} bytes" in letters[0].reason
    assert letters[0].raw_truncated and letters[0].raw_size == len(encode(big))  # cut to fit its own limit
    on_scored = [decode(r.value) for r in read_records(t, t.names.scored)]
    notices = [m for m in on_scored if isinstance(m, MemberRejected)]
    assert [(n.group_id, n.rollout_id, n.error_type) for n in notices] == [
        (big.group_id, big.rollout_id, "RecordTooLarge")]
    scored_ids = {m.rollout_id for m in on_scored if isinstance(m, ScoredRollout)}
    assert scored_ids == {r.rollout_id for r in good} - {big.rollout_id}
    batches = [json.loads(r.getMessage().split(" ", 2)[2]) for r in caplog.records
               if r.getMessage().startswith("scorer batch ")]
    logged = (sum(b["scorer/scored"] for b in batches), sum(b["scorer/rejected"] for b in batches))
    assert logged == (11, 1)  # the batch log agrees with what was sent: the too-large one is not "scored"

@pytest.mark.broker
def test_producer_dead_letters_the_prompt_of_a_group_too_large_and_goes_on(make_config):
    from stream_rl.demo.tokenizer import build_tokenizer

    role, outside = _configs(make_config)
    t = Transport(outside, "test")
    big = dataclasses.replace(prompt_record(1), metadata={"blob": BLOB})
    send_prompts(t, [prompt_record(0), big, prompt_record(2)])
    pcfg = ProducerConfig(follow_weights=False, prompts_per_batch=3, max_new_tokens=4, poll_timeout_s=0.3)
    thread, stop, stats, out = start_producer(role, pcfg, FakeEngine(build_tokenizer()))
    group = t.names.group("producers")
    wait_for(lambda: committed(t, group).get((t.names.prompts, 0)) == 3, "the producer's commit past all 3", 40,
             watch=[out])
    stop_producer(thread, stop, out)
    letters = [d.value for d in read_records(t, t.names.dlq, "dead_letter")]
    assert [(d.error_type, d.source_offset) for d in letters] == [("RecordTooLarge", 1)]
    assert f"more than kafka.max_request_size = {LIMIT} bytes" in letters[0].reason
    groups = {r.value.group_id for r in read_records(t, t.names.rollouts, "rollout")}
    assert groups == {group_id_for("p0", 0), group_id_for("p2", 0)}  # no member of the too-large group was sent
