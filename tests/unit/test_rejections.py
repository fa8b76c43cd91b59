"""Naming the group of a rejected record (stream_rl/transport/rejections.py): only from a decoded rollout or a
key that is a well-formed group id, never guessed."""

from __future__ import annotations

from dataclasses import replace

from support import messages as samples

from schemas import decode, encode
from stream_rl.transport.rejections import EdgeRejection, group_of, member_rejected, notice_of


def test_a_decoded_rollout_names_its_group_id_and_attempt_whatever_its_key():
    rollout = replace(samples.rollout(3, sample=2), attempt=1)
    assert group_of(rollout, b"wrong key") == ("p3:0", "p3:0:2", 1)  # a KeyError rejection: the value decides
    assert group_of(samples.scored(4, 1), None) == ("p4:0", "p4:0:1", 0)


def test_an_undecodable_record_names_a_group_only_through_a_group_id_key():
    assert group_of(None, b"p9:12") == ("p9:12", None, None)
    assert group_of(None, b"a:b:c:7") == ("a:b:c:7", None, None)  # prompt ids may contain ":"
    for key in (None, b"junk", b"p9", b"p9:", b"p9:07", b"p9:-1", b":3", b"\xff\xfe:1", b"p 9:1", b"p" * 201 + b":0"):
        assert group_of(None, key) is None, key
    assert group_of(samples.prompt(1), b"p1:0") is None  # a decoded record of another kind is not a member


def test_the_notice_carries_what_its_dead_letter_says_and_round_trips():
    rejection = EdgeRejection("stream-rl.r.rollouts", 2, 41, b"p9:0", None, "invalid message: not valid msgpack",
                              "SchemaError")
    notice = notice_of(rejection, "scorer-7")
    assert (notice.group_id, notice.rollout_id, notice.attempt) == ("p9:0", None, None)
    assert (notice.source_topic, notice.source_partition, notice.source_offset) == ("stream-rl.r.rollouts", 2, 41)
    assert (notice.reason, notice.error_type, notice.consumer_id) == (rejection.reason, "SchemaError", "scorer-7")
    assert decode(encode(notice), "member_rejected") == notice
    assert notice_of(rejection._replace(key=b"junk"), "scorer-7") is None
    long = member_rejected(samples.rollout(1), b"p1:0", topic="t", partition=0, offset=0, reason="x" * 9000,
                           error_type="ValueError", consumer_id="scorer-7")
    assert len(long.reason) == 4000 and long.rollout_id == "p1:0:0"
