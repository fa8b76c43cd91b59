"""Poison records never crash-loop a role: records in every codec from an outside client are scored; batches the
client cannot read, oversized, null, untraced-or-traced invalid records and rollouts a model cannot take all
reach the dead-letter topic with a reason while the scorer goes on; `stream-rl replay` reports what it cannot
read and goes on. Also the dead letter's own schema (truncation, digests, older records)."""

from __future__ import annotations

import hashlib
import json
import threading

import kafka.codec
import msgpack
import numpy as np
import pytest
import torch
from kafka import KafkaProducer
from support.messages import rollout_for_scoring
from support.scorer import VOCAB, ScorerThread, group_rollouts, llama_config, send_rollouts, trace_id
from support.topics import read_records
from support.waiting import wait_for
from transformers import LlamaForCausalLM
from typer.testing import CliRunner

from consumers.scorer.builtin_rewards import exact_match
from consumers.scorer.config import ScorerConfig
from consumers.scorer.reference import ReferenceLogprobs
from consumers.scorer.scorer import ScorerDeps, run_scorer
from consumers.scorer.scoring import Scoring
from schemas import DeadLetter, SchemaError, decode, encode, message_kind
from stream_rl.cli.main import app
from stream_rl.transport.client import Transport
from stream_rl.transport.edge import raw_budget
from stream_rl.transport.tracing import Tracing

CODECS = ("gzip", "lz4", "zstd", "snappy")
PAD = {"pad": "compressible " * 200}  # librdkafka sends a batch uncompressed when compression does not shrink it


# ---------------------------------------------------------------- the dead letter's schema


def letter_fields(**extra):
    return dict(reason="bad", error_type="SchemaError", source_topic="t", source_partition=0, source_offset=7,
                raw_key=b"k", consumer_id="scorer-1", **extra)


def test_dead_letter_of_a_big_value_is_truncated_with_size_and_digest_and_fits():
    value = bytes(range(256)) * 8192  # 2 MiB
    letter = DeadLetter.of_value(value, raw_budget(1_048_576, b"k"), **letter_fields())
    assert letter.raw_truncated and letter.raw_size == len(value)
    assert letter.raw_sha256 == hashlib.sha256(value).hexdigest() and value.startswith(letter.raw_value)
    assert len(encode(letter)) < 1_048_576 // 2
    back = decode(encode(letter), "dead_letter")
    assert back == letter
    small = DeadLetter.of_value(b"abc", 100, **letter_fields())
    assert (small.raw_value, small.raw_size, small.raw_truncated) == (b"abc", 3, False)
    null = DeadLetter.of_value(None, 100, **letter_fields())
    assert null.raw_value is None and null.raw_size is None and null.raw_sha256 is None
    assert decode(encode(null), "dead_letter").raw_value is None


def test_dead_letter_raw_fields_must_agree_and_older_records_still_read():
    with pytest.raises(SchemaError, match="raw_truncated"):
        encode(DeadLetter(raw_value=b"ab", raw_size=2, raw_truncated=True, **letter_fields()))
    with pytest.raises(SchemaError, match="raw_size: must equal len"):
        encode(DeadLetter(raw_value=b"ab", raw_size=5, **letter_fields()))
    with pytest.raises(SchemaError, match="raw_sha256: does not match"):
        encode(DeadLetter(raw_value=b"ab", raw_sha256="0" * 64, **letter_fields()))
    with pytest.raises(SchemaError, match="raw_size: must be nil"):
        encode(DeadLetter(raw_value=None, raw_size=0, **letter_fields()))
    wire = msgpack.unpackb(encode(DeadLetter.of_value(b"xyz", 100, **letter_fields())), raw=False)
    for added in ("raw_size", "raw_sha256", "raw_truncated"):
        del wire[added]  # a dead letter written before these fields existed
    old = decode(msgpack.packb(wire, use_bin_type=True), "dead_letter")
    assert (old.raw_value, old.raw_size, old.raw_sha256, old.raw_truncated) == (b"xyz", None, None, False)


# ---------------------------------------------------------------- outside clients and unreadable batches


def outside_produce(bootstrap: str, topic: str, rollouts, codec: str, partition: int | None = None) -> None:
    """Write ``rollouts`` with librdkafka (confluent-kafka), compressed with ``codec``, as one batch."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "compression.type": codec, "linger.ms": 50,
                         "partitioner": "murmur2_random"})
    for r in rollouts:
        kwargs = {} if partition is None else {"partition": partition}
        producer.produce(topic, value=encode(r), key=r.group_id.encode(), **kwargs)
    assert producer.flush(15) == 0


@pytest.mark.broker
def test_scorer_scores_rollouts_an_outside_client_wrote_in_every_codec(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 2, "scored": 2}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sent = {}
    for k, codec in enumerate(CODECS):
        rollouts = group_rollouts(10 * k, 1, metadata=PAD)
        outside_produce(t.bootstrap, t.names.rollouts, rollouts, codec)
        sent[codec] = {r.rollout_id for r in rollouts}
    scorer = ScorerThread(cfg, ScorerConfig(reward_fn="consumers.scorer.builtin_rewards:exact_match",
                                            batch_size=8, poll_timeout_s=0.3))
    every = set().union(*sent.values())
    wait_for(lambda: every <= {s.value.rollout_id for s in read_records(t, t.names.scored, "scored_rollout")},
             "every codec's rollouts scored", 40, watch=[scorer])
    stats = scorer.finish()
    assert stats.scored == 16 and stats.rejected == 0
    assert read_records(t, t.names.dlq) == []


@pytest.mark.broker
def test_a_batch_the_client_cannot_decode_is_dead_lettered_and_skipped_not_crash_looped(make_config, monkeypatch):
    cfg = make_config(**{"topics.partitions": {"rollouts": 1, "scored": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    before, poison, after = group_rollouts(0, 1), group_rollouts(1, 1, metadata=PAD), group_rollouts(2, 1)
    send_rollouts(t, before)                                              # offsets 0..3
    outside_produce(t.bootstrap, t.names.rollouts, poison, "lz4", 0)      # 4..7, one lz4 batch
    send_rollouts(t, after)                                               # 8..11
    monkeypatch.setattr(kafka.codec, "has_lz4", lambda: False)  # this process now reads like a client without lz4
    scfg = ScorerConfig(reward_fn="consumers.scorer.builtin_rewards:exact_match", batch_size=4, poll_timeout_s=0.3)
    scorer = ScorerThread(cfg, scfg)
    wanted = {r.rollout_id for r in before + after}
    wait_for(lambda: wanted <= {s.value.rollout_id for s in read_records(t, t.names.scored, "scored_rollout")}
             and len(read_records(t, t.names.dlq)) >= 4, "8 scored and 4 dead letters", 40, watch=[scorer])
    stats = scorer.finish()
    assert stats.scored == 8
    letters = [d.value for d in read_records(t, t.names.dlq, "dead_letter")]
    assert sorted(d.source_offset for d in letters) == [4, 5, 6, 7]
    for d in letters:
        assert d.error_type == "UnsupportedCodecError" and "lz4" in d.reason and "offsets 4..7" in d.reason
        assert d.raw_value is None and d.source_topic == t.names.rollouts and d.source_partition == 0

    # a restart in the same group starts after the skipped batch: nothing dead-lettered or scored again
    scorer = ScorerThread(cfg, scfg)
    send_rollouts(t, group_rollouts(3, 1))
    wait_for(lambda: len(read_records(t, t.names.scored)) >= 12, "the next group scored", 40, watch=[scorer])
    assert scorer.finish().scored == 4 and len(read_records(t, t.names.dlq)) == 4

    # replay reports the unreadable offsets and reads on
    out = CliRunner().invoke(app, ["replay", "rollouts", "--show-content", "--bootstrap", t.bootstrap, "--run",
                                  cfg.topics.run])
    assert out.exit_code == 0, out.output
    lines = [json.loads(x) for x in out.output.splitlines() if x.startswith("{")]
    assert [x["offset"] for x in lines] == list(range(16))
    assert [x["offset"] for x in lines if x.get("unreadable")] == [4, 5, 6, 7]
    assert "UnsupportedCodecError" in lines[4]["error"] and lines[8]["value"]["rollout_id"] == after[0].rollout_id


# ---------------------------------------------------------------- invalid records of every sort, one scorer run


def reference_scoring() -> Scoring:
    torch.manual_seed(0)
    return Scoring(scorer_id="scorer-poison", reward_fn=exact_match,
                   reference=ReferenceLogprobs(LlamaForCausalLM(llama_config()).eval()))


@pytest.mark.broker
def test_oversized_null_invalid_and_unscorable_records_are_dead_lettered_and_the_scorer_goes_on(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 1, "scored": 1}})
    t = Transport(cfg, "test", tracing=Tracing("producer-test"))
    t.ensure_topics()
    good = group_rollouts(0, 1)
    sink = t.sink()
    sink.send_raw(t.names.rollouts, b"\xc1 traced garbage", key=b"junk")                        # offset 0
    sink.send_raw(t.names.rollouts, None, key=b"tombstone")                                     # 1
    sink.flush()
    big = b"\xc1" + bytes(1_500_000)  # an invalid record over 1 MiB (written by a client with a larger limit)
    raw = KafkaProducer(bootstrap_servers=t.bootstrap, max_request_size=4_000_000)
    raw.send(t.names.rollouts, value=big, key=b"big").get(10)                                   # 2
    raw.close()
    bad_token = rollout_for_scoring(7, response_ids=(3, VOCAB))  # a token id equal to the vocabulary size
    too_long = rollout_for_scoring(8, prompt_ids=tuple(range(1, 31)), response_ids=(3, 4, 5))  # > 32 positions
    send_rollouts(t, [bad_token, too_long] + good)                                              # 3, 4, 5..8
    sink.send_raw(t.names.rollouts, b"\xc1 keyed by its group", key=b"p9:0")                   # 9
    sink.flush()
    stop, box = threading.Event(), {}
    thread = threading.Thread(target=lambda: box.update(stats=run_scorer(
        cfg, ScorerConfig(batch_size=4, poll_timeout_s=0.3), stop,
        deps=ScorerDeps(scoring=reference_scoring()))))
    thread.start()
    try:
        wait_for(lambda: len(read_records(t, t.names.scored)) >= 7 and len(read_records(t, t.names.dlq)) >= 6,
                 "4 scored, 3 member_rejected and 6 dead letters", 60)
    finally:
        stop.set()
        thread.join(30)
    assert box["stats"].scored == 4 and box["stats"].rejected == 2
    dlq = {d.value.source_offset: d for d in read_records(t, t.names.dlq, "dead_letter")}
    assert sorted(dlq) == [0, 1, 2, 3, 4, 9]
    source = {r.offset: r for r in read_records(t, t.names.rollouts)}
    assert trace_id(dlq[0].headers) == trace_id(source[0].headers)  # continues the rejected record's trace
    assert dlq[0].value.raw_value == b"\xc1 traced garbage" and dlq[0].value.raw_size == 16
    assert dlq[1].value.raw_value is None and "expected bytes" in dlq[1].value.reason  # a null value stays nil
    letter = dlq[2].value
    assert letter.raw_truncated and letter.raw_size == len(big) and big.startswith(letter.raw_value)
    assert letter.raw_sha256 == hashlib.sha256(big).hexdigest() and len(letter.raw_value) < 600_000
    assert "vocabulary of 32" in dlq[3].value.reason and "max_position_embeddings 32" in dlq[4].value.reason
    assert trace_id(dlq[3].headers) == trace_id(source[3].headers)
    scored = read_records(t, t.names.scored, "scored_rollout")
    assert sorted(s.value.rollout_id for s in scored) == sorted(r.rollout_id for r in good)
    # every rejected rollout that names its group is announced on scored, keyed by the group (none for "junk")
    notices = [r for r in read_records(t, t.names.scored) if message_kind(r.value) == "member_rejected"]
    got = {(r.key, (n := decode(r.value, "member_rejected")).rollout_id, n.attempt, n.source_offset, n.error_type)
           for r in notices}
    assert got == {(bad_token.group_id.encode(), bad_token.rollout_id, 0, 3, "ValueError"),
                   (too_long.group_id.encode(), too_long.rollout_id, 0, 4, "ValueError"),
                   (b"p9:0", None, None, 9, "SchemaError")}
    assert all(decode(r.value, "member_rejected").reason == dlq[decode(r.value).source_offset].value.reason
               for r in notices)
    assert all(np.isfinite(s.value.ref_logprobs).all() for s in scored)
