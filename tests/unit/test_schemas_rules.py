"""Every validation rule of the wire schemas raises SchemaError naming the right field, on both sides of the wire.

Value cases are checked twice: ``validate`` (what a producer runs before sending) and ``decode`` of the same bad
message written without validation (what a consumer sees). Type cases are written straight into the wire map.
"""

from __future__ import annotations

import math
from dataclasses import replace

import msgpack
import numpy as np
import pytest
from support.messages import (
    DROP,
    make_chunk,
    make_dead_letter,
    make_manifest,
    make_prompt,
    make_rollout,
    make_scored,
    make_stale,
    rewrite,
    sha,
)

from schemas import SchemaError, WeightsChunk, decode, encode, validate
from schemas.validation import message_to_wire

NAN, INF = math.nan, math.inf


def f32(*values):
    return np.array(values, np.float32)


def i32(*values):
    return np.array(values, np.int32)


def entries(mutate):
    """A manifest whose tensor list was passed through ``mutate``."""
    manifest = make_manifest()[1]
    return replace(manifest, tensors=mutate(list(manifest.tensors)))


R = make_rollout
VALUE_CASES = [
    # rollout
    (lambda: R(rollout_id="has space"), "rollout_id", "malformed id"),
    (lambda: R(rollout_id="p0:1:3"), "rollout_id", "rollout_id_for"),
    (lambda: R(prompt_id="", rollout_id="x", group_id="x"), "prompt_id", "malformed id"),
    (lambda: R(prompt_id="p" * 201), "prompt_id", "longer than 200"),
    (lambda: R(group_id="p0:2"), "group_id", "group_id_for"),
    (lambda: R(epoch=-1), "epoch", "must be >= 0"),
    (lambda: R(sample_index=-1), "sample_index", "must be >= 0"),
    (lambda: R(sample_index=4, rollout_id="p0:1:4"), "sample_index", "must be < group_size (4)"),
    (lambda: R(group_size=0), "group_size", "must be >= 1"),
    (lambda: R(prompt_token_ids=i32()), "prompt_token_ids", "at least 1"),
    (lambda: R(prompt_token_ids=i32(3, -1)), "prompt_token_ids", "-1 at index 1"),
    (lambda: R(prompt_token_ids=np.array([3, 4], np.int64)), "prompt_token_ids", "int32"),
    (lambda: R(prompt_token_ids=i32(3, 4).reshape(1, 2)), "prompt_token_ids", "1-D"),
    (lambda: R(response_token_ids=i32()), "response_token_ids", "at least 1"),
    (lambda: R(response_token_ids=i32(1, 2, 3)), "behavior_logprobs", "length 4 != response length 3"),
    (lambda: R(behavior_logprobs=f32(-1, NAN, 0, 0)), "behavior_logprobs", "NaN at index 1"),
    (lambda: R(behavior_logprobs=f32(-1, -1, -INF, 0)), "behavior_logprobs", "inf at index 2"),
    (lambda: R(behavior_logprobs=f32(-1, -1, 1e-6, 0)), "behavior_logprobs", "<= 0.0"),
    (lambda: R(behavior_logprobs=np.array([-1, -1, -1, 0], np.float64)), "behavior_logprobs", "float32"),
    (lambda: R(behavior_logprobs=f32(-1, -1, -1)), "behavior_logprobs", "length 3"),
    (lambda: R(token_policy_versions=np.array([1, -1, 1, 1], np.int64)), "token_policy_versions", ">= 0"),
    (lambda: R(token_policy_versions=np.array([1, 1, 1, 1], np.int32)), "token_policy_versions", "int64"),
    (lambda: R(token_policy_versions=np.ones(5, np.int64)), "token_policy_versions", "length 5"),
    (lambda: R(finish_reason="eos"), "finish_reason", "one of"),
    (lambda: R(producer_id="-lead"), "producer_id", "malformed id"),
    (lambda: R(temperature=0.0), "temperature", "> 0"),
    (lambda: R(temperature=NAN), "temperature", "finite"),
    (lambda: R(attempt=-1), "attempt", ">= 0"),
    (lambda: R(timings={"generate_s": INF}), "timings.generate_s", "finite"),
    # scored rollout
    (lambda: replace(make_scored(), rollout=R(behavior_logprobs=f32(0, 0, NAN, 0))), "rollout.behavior_logprobs",
     "NaN"),
    (lambda: replace(make_scored(), rollout=R(epoch=-2)), "rollout.epoch", ">= 0"),
    (lambda: replace(make_scored(), reward=NAN), "reward", "finite"),
    (lambda: replace(make_scored(), reward_components={"kl": -INF}), "reward_components.kl", "finite"),
    (lambda: replace(make_scored(), token_rewards=f32(0, 0)), "token_rewards", "length 2 != response length 4"),
    (lambda: replace(make_scored(), token_rewards=f32(0, INF, 0, 0)), "token_rewards", "inf"),
    (lambda: replace(make_scored(), ref_logprobs=f32(-1, 0.5, -1, -1)), "ref_logprobs", "<= 0.0"),
    (lambda: replace(make_scored(), ref_logprobs=f32(-1)), "ref_logprobs", "length 1"),
    (lambda: replace(make_scored(), scorer_id="a b"), "scorer_id", "malformed"),
    # prompt
    (lambda: replace(make_prompt(), prompt_id="p?"), "prompt_id", "malformed"),
    (lambda: replace(make_prompt(), epoch=-1), "epoch", ">= 0"),
    (lambda: replace(make_prompt(), group_size=0), "group_size", ">= 1"),
    (lambda: replace(make_prompt(), group_size=10**9), "group_size", "<= 65536"),
    (lambda: replace(make_prompt(), attempt=-1), "attempt", ">= 0"),
    (lambda: replace(make_prompt(), prompt_token_ids=i32(-5)), "prompt_token_ids", ">= 0"),
    (lambda: replace(make_prompt(), prompt_token_ids=f32(1)), "prompt_token_ids", "int32"),
    (lambda: replace(make_prompt(), prompt_token_ids=i32()), "prompt_token_ids", "at least 1"),
    (lambda: replace(make_prompt(), created_at=INF), "created_at", "finite"),
    # weights manifest
    (lambda: replace(make_manifest()[1], version=-1), "version", ">= 0"),
    (lambda: replace(make_manifest()[1], step=-1), "step", ">= 0"),
    (lambda: replace(make_manifest()[1], mode="ftp"), "mode", "one of"),
    (lambda: entries(lambda t: []), "tensors", "non-empty"),
    (lambda: entries(lambda t: [replace(t[0], dtype="F33"), *t[1:]]), "tensors[0].dtype", "one of"),
    (lambda: entries(lambda t: [replace(t[0], name=""), *t[1:]]), "tensors[0].name", "empty"),
    (lambda: entries(lambda t: [replace(t[0], shape=(3, -4)), *t[1:]]), "tensors[0].shape", "non-negative"),
    (lambda: entries(lambda t: [t[0], replace(t[1], nbytes=4), t[2]]), "tensors[1].nbytes", "= 6"),
    (lambda: entries(lambda t: [t[0], replace(t[1], offset=50), t[2]]), "tensors[1].offset", "must be 48"),
    (lambda: entries(lambda t: [t[0], replace(t[1], offset=40), t[2]]), "tensors[1].offset", "must be 48"),
    (lambda: entries(lambda t: [t[1], t[0], t[2]]), "tensors[0].offset", "must be 0"),
    (lambda: entries(lambda t: [t[0], replace(t[1], name=t[0].name), t[2]]), "tensors[1].name", "duplicate"),
    (lambda: replace(make_manifest()[1], total_bytes=63), "total_bytes", "(62)"),
    (lambda: replace(make_manifest()[1], sha256="AB" * 32), "sha256", "malformed"),
    (lambda: replace(make_manifest()[1], sha256="ab" * 31), "sha256", "malformed"),
    (lambda: replace(make_manifest()[1], chunk_size=0), "chunk_size", ">= 1"),
    (lambda: replace(make_manifest()[1], chunk_count=3), "chunk_count", "= 2"),
    (lambda: replace(make_manifest()[1], chunks_topic=None), "chunks_topic", "required in inline mode"),
    (lambda: replace(make_manifest()[1], store_uri="/w"), "store_uri", "must be nil in inline mode"),
    (lambda: replace(make_manifest()[1], chunks_topic="bad topic"), "chunks_topic", "topic name"),
    (lambda: replace(make_manifest("store")[1], store_uri=None), "store_uri", "required in store mode"),
    (lambda: replace(make_manifest("store")[1], store_uri=""), "store_uri", "empty"),
    (lambda: replace(make_manifest("store")[1], chunks_topic="t"), "chunks_topic", "must be nil in store mode"),
    (lambda: replace(make_manifest()[1], trainer_id=""), "trainer_id", "malformed"),
    # weights chunk
    (lambda: replace(make_chunk(), version=-1), "version", ">= 0"),
    (lambda: replace(make_chunk(), index=2), "index", "must be < count (2)"),
    (lambda: replace(make_chunk(), count=0), "count", ">= 1"),
    (lambda: WeightsChunk(version=1, index=0, count=1, data=b"", sha256=sha(b"")), "data", "empty"),
    (lambda: replace(make_chunk(), data=b"\x00\x01\xfe" * 5), "sha256", "does not match"),
    # dead letter
    (lambda: replace(make_dead_letter(), reason=""), "reason", "empty"),
    (lambda: replace(make_dead_letter(), error_type=""), "error_type", "empty"),
    (lambda: replace(make_dead_letter(), source_topic="a/b"), "source_topic", "topic name"),
    (lambda: replace(make_dead_letter(), source_partition=-1), "source_partition", ">= 0"),
    (lambda: replace(make_dead_letter(), source_offset=-1), "source_offset", ">= 0"),
    (lambda: replace(make_dead_letter(), consumer_id=""), "consumer_id", "malformed"),
    # stale rollout
    (lambda: replace(make_stale(), group_id="p0:2"), "group_id", "group_id_for"),
    (lambda: replace(make_stale(), rollout_id="p1:1:3"), "rollout_id", "p0:1:<i>"),
    (lambda: replace(make_stale(), rollout_id="p0:1:x"), "rollout_id", "p0:1:<i>"),
    (lambda: replace(make_stale(), rollout_id="p0:1:03"), "rollout_id", "p0:1:<i>"),
    (lambda: replace(make_stale(), lag=-1), "lag", ">= 0"),
    (lambda: replace(make_stale(), max_lag=-1), "max_lag", ">= 0"),
    (lambda: replace(make_stale(), trainer_version=-1), "trainer_version", ">= 0"),
    (lambda: replace(make_stale(), reason=""), "reason", "empty"),
]


def case_id(case) -> str:
    return case[1]


def check(err: SchemaError, kind: str, field: str, reason: str) -> None:
    assert err.kind == kind, str(err)
    assert err.field in (field, f"{field}.dtype"), str(err)
    assert reason in err.reason or reason in str(err), str(err)


@pytest.mark.parametrize("build, field, reason", VALUE_CASES, ids=[case_id(c) for c in VALUE_CASES])
def test_value_rules_fire_before_sending_and_after_receiving(build, field, reason):
    bad = build()
    with pytest.raises(SchemaError) as info:
        validate(bad)
    assert info.value.field == field, str(info.value)
    check(info.value, bad.KIND, field, reason)
    with pytest.raises(SchemaError) as info:
        encode(bad)
    assert info.value.field == field
    unchecked = msgpack.packb(message_to_wire(bad), use_bin_type=True)
    with pytest.raises(SchemaError) as info:
        decode(unchecked)
    check(info.value, bad.KIND, field, reason)


def test_boundary_values_are_accepted():
    ok = [R(behavior_logprobs=f32(0, 0, 0, 0), finish_reason="abort", temperature=1e-6),
          R(sample_index=3, rollout_id="p0:1:3", epoch=1, token_policy_versions=np.zeros(4, np.int64)),
          replace(make_manifest()[1], chunk_size=62, chunk_count=1), replace(make_manifest()[1], chunk_size=31),
          replace(make_manifest("store")[1], chunk_size=10**6, chunk_count=1),
          replace(make_dead_letter(), raw_value=None, raw_key=None), replace(make_scored(), token_rewards=None,
                                                                             ref_logprobs=None)]
    for msg in ok:
        assert decode(encode(msg)) == msg


def array_map(dtype: str, shape, data: bytes) -> dict:
    return {"dtype": dtype, "shape": shape, "data": data}


ROLLOUT = encode(make_rollout())
LOGPROBS = f32(-0.25, -1.5, 0.0, -3.0)
TYPE_CASES = [
    (ROLLOUT, {"epoch": "1"}, "epoch", "expected int, got str"),
    (ROLLOUT, {"epoch": True}, "epoch", "expected int, got bool"),
    (ROLLOUT, {"epoch": 2**64 - 1}, "epoch", "int64 range"),
    (ROLLOUT, {"epoch": 1.0}, "epoch", "expected int, got float"),
    (ROLLOUT, {"temperature": "0.7"}, "temperature", "expected float"),
    (ROLLOUT, {"temperature": None}, "temperature", "expected float, got nil"),
    (ROLLOUT, {"prompt_text": b"bytes"}, "prompt_text", "expected str, got bin"),
    (ROLLOUT, {"answer": 4}, "answer", "expected str"),
    (ROLLOUT, {"metadata": ["task"]}, "metadata", "expected map"),
    (ROLLOUT, {"metadata": {"task": 1}}, "metadata.task", "expected str"),
    (ROLLOUT, {"timings": {"generate_s": "fast"}}, "timings.generate_s", "expected float"),
    (ROLLOUT, {"behavior_logprobs": LOGPROBS.tolist()}, "behavior_logprobs", "array map"),
    (ROLLOUT, {"behavior_logprobs": array_map("<f8", [4], LOGPROBS.astype("<f8").tobytes())},
     "behavior_logprobs.dtype", "expected '<f4'"),
    (ROLLOUT, {"behavior_logprobs": array_map(">f4", [4], LOGPROBS.astype(">f4").tobytes())},
     "behavior_logprobs.dtype", "unsupported dtype"),
    (ROLLOUT, {"behavior_logprobs": array_map("<f4", [5], LOGPROBS.tobytes())}, "behavior_logprobs.data",
     "16 bytes for shape [5]"),
    (ROLLOUT, {"behavior_logprobs": array_map("<f4", [1, 4], LOGPROBS.tobytes())}, "behavior_logprobs", "1-D"),
    (ROLLOUT, {"behavior_logprobs": array_map("<f4", [-4], LOGPROBS.tobytes())}, "behavior_logprobs.shape",
     "non-negative"),
    (ROLLOUT, {"behavior_logprobs": {"dtype": "<f4", "shape": [4]}}, "behavior_logprobs.data", "missing"),
    (ROLLOUT, {"behavior_logprobs": array_map("<f4", [4], "text")}, "behavior_logprobs.data", "expected bin"),
    (ROLLOUT, {"behavior_logprobs": msgpack.ExtType(1, b"x")}, "behavior_logprobs", "ExtType"),
    (encode(make_scored()), {"rollout": {**msgpack.unpackb(ROLLOUT), "kind": "prompt"}}, "rollout.kind",
     "expected 'rollout'"),
    (encode(make_scored()), {"rollout": {**msgpack.unpackb(ROLLOUT), "schema_version": 2}},
     "rollout.schema_version", "unsupported version 2"),
    (encode(make_scored()), {"rollout": {**msgpack.unpackb(ROLLOUT), "epoch": DROP}}, "rollout.epoch", "missing"),
    (encode(make_scored()), {"rollout": "p0:1:2"}, "rollout", "expected a msgpack map"),
    (encode(make_manifest()[1]), {"tensors": {"w": 1}}, "tensors", "non-empty array"),
    (encode(make_manifest()[1]), {"tensors": ["w"]}, "tensors[0]", "expected map"),
    (encode(make_manifest()[1]), {"tensors": [{"name": "w", "dtype": "F32", "shape": [1], "offset": 0}]},
     "tensors[0].nbytes", "missing"),
    (encode(make_chunk()), {"data": "text"}, "data", "expected bin, got str"),
    (encode(make_stale()), {"requeued": 1}, "requeued", "expected bool"),
    (encode(make_dead_letter()), {"raw_value": "abc"}, "raw_value", "expected bin"),
]


def _drop_nested(value):
    if isinstance(value, dict):
        return {k: _drop_nested(v) for k, v in value.items() if v is not DROP}
    return value


@pytest.mark.parametrize("data, changes, field, reason", TYPE_CASES, ids=[c[2] for c in TYPE_CASES])
def test_wire_type_rules_name_the_field(data, changes, field, reason):
    bad = rewrite(data, **{k: _drop_nested(v) for k, v in changes.items()})
    with pytest.raises(SchemaError) as info:
        decode(bad)
    assert info.value.field == field, str(info.value)
    assert reason in info.value.reason, str(info.value)
    assert info.value.kind == msgpack.unpackb(data)["kind"]


def test_an_int_on_the_wire_is_read_as_a_float():
    msg = decode(rewrite(ROLLOUT, temperature=2, timings={"generate_s": 1}))
    assert msg.temperature == 2.0 and type(msg.temperature) is float and type(msg.timings["generate_s"]) is float
