"""The codec's fast paths reject exactly what the rule-by-rule checks reject, with the same messages.

Covers the fused array pass (one min/max pass decides; only an array it does not clear is scanned rule by rule), the
one-pass decode (``read``: conversion and checks together), and the array wire encoding's shortcuts (native
little-endian arrays written with one ``tobytes``, other byte orders and layouts converted first).
"""

from __future__ import annotations

import math
from dataclasses import replace

import msgpack
import numpy as np
import pytest
from support.messages import make_rollout, make_scored

from schemas import SchemaError, decode, decode_array, encode, encode_array, validate
from schemas.fields import Array
from schemas.spec import fields_from_wire, read_fields
from schemas.validation import SPECS, message_to_wire

NAN, INF = math.nan, math.inf
LOGPROBS = Array("<f4", finite=True, maximum=0.0)  # the behaviour / reference log-probability rule
TOKENS = Array("<i4", min_len=1, minimum=0)  # the token id rule
REWARDS = Array("<f4", finite=True)  # the token reward rule


def f32(*values):
    return np.array(values, np.float32)


def _written_unchecked(msg) -> bytes:
    """``msg``'s record value as an unvalidating writer would send it."""
    return msgpack.packb(message_to_wire(msg), use_bin_type=True)


# One bad value per rule, in each array field of a scored rollout: (field path, message kwargs, expected reason).
CASES = [
    ("rollout.behavior_logprobs", {"behavior_logprobs": f32(-1, NAN, 0, 0)}, "contains NaN at index 1"),
    ("rollout.behavior_logprobs", {"behavior_logprobs": f32(-1, -1, -INF, 0)}, "contains inf at index 2"),
    ("rollout.behavior_logprobs", {"behavior_logprobs": f32(-1, INF, 0, 0)}, "contains inf at index 1"),
    ("rollout.behavior_logprobs", {"behavior_logprobs": f32(-1, -1, 0, 0.5)},
     "contains 0.5 at index 3; values must be <= 0.0"),
    ("rollout.response_token_ids", {"response_token_ids": np.array([3, 4, -5, 6], np.int32)},
     "contains -5 at index 2; values must be >= 0"),
    ("rollout.prompt_token_ids", {"prompt_token_ids": np.array([-1, 2], np.int32)},
     "contains -1 at index 0; values must be >= 0"),
    ("rollout.token_policy_versions", {"token_policy_versions": np.array([0, 1, 2, -3], np.int64)},
     "contains -3 at index 3; values must be >= 0"),
]


@pytest.mark.parametrize("field,change,reason", CASES, ids=[f"{c[0]}:{c[2][:16]}" for c in CASES])
def test_each_array_rule_rejects_its_bad_value_naming_the_field_on_both_sides(field, change, reason):
    scored = replace(make_scored(), rollout=make_rollout(**change))
    expected = f"invalid scored_rollout.{field}: {reason}"
    with pytest.raises(SchemaError) as sent:
        validate(scored)
    assert str(sent.value) == expected
    with pytest.raises(SchemaError) as received:
        decode(_written_unchecked(scored), "scored_rollout")
    assert str(received.value) == expected


@pytest.mark.parametrize("name,values,reason", [
    ("ref_logprobs", f32(-1, -2, NAN, 0), "contains NaN at index 2"),
    ("ref_logprobs", f32(-1, 1e-3, 0, 0), "values must be <= 0.0"),
    ("token_rewards", f32(0, 1, -INF, 0), "contains inf at index 2"),
    ("token_rewards", f32(NAN, 1, 2, 3), "contains NaN at index 0"),
])
def test_the_scored_arrays_rules_reject_on_both_sides(name, values, reason):
    scored = replace(make_scored(), **{name: values})
    for check in (lambda: validate(scored), lambda: decode(_written_unchecked(scored))):
        with pytest.raises(SchemaError, match=f"^invalid scored_rollout.{name}: .*{reason}"):
            check()


def test_the_shape_and_dtype_rules_name_the_field():
    for values, reason in ((np.zeros((2, 2), np.float32), "expected a 1-D array"),
                           (np.zeros(4, np.float64), "expected dtype float32"),
                           (np.zeros(0, np.int32), "expected at least 1 element")):
        field = Array("<i4", min_len=1) if values.dtype == np.int32 else LOGPROBS
        with pytest.raises(SchemaError, match=reason) as err:
            field.check(values)
        assert err.value.field == "<root>"


def test_the_edge_values_the_rules_allow_pass():
    LOGPROBS.check(f32(0.0, -0.0, -3.4e38, -1e-45))  # log 1 rounds to 0.0; the most negative finite float32
    REWARDS.check(f32(3.4e38, -3.4e38))
    TOKENS.check(np.array([0, 2**31 - 1], np.int32))
    Array("<f4").check(f32(NAN, INF))  # no value rule: nothing is scanned
    Array("<i8", minimum=0).check(np.zeros(0, np.int64))  # empty, min_len 0


def test_fused_pass_agrees_with_the_rule_by_rule_scan_on_random_arrays():
    rng = np.random.default_rng(7)
    specials = np.array([NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38], np.float32)
    fields = (LOGPROBS, REWARDS, Array("<f4", minimum=-1.0), Array("<f4", minimum=-2.0, maximum=2.0))
    for _ in range(400):
        values = -rng.exponential(1.0, int(rng.integers(1, 12))).astype(np.float32)
        hits = rng.integers(0, values.size, int(rng.integers(0, 3)))
        values[hits] = rng.choice(specials, hits.size)
        for field in fields:
            try:
                field._check_values(values)
                scan_ok = True
            except SchemaError:
                scan_ok = False
            if field._values_clear(values):
                assert scan_ok, (field.__dict__, values)  # the fused pass never clears what the scan rejects
            if not scan_ok:
                with pytest.raises(SchemaError):
                    field.check(values)


def test_one_pass_read_equals_convert_then_check():
    wire = message_to_wire(make_rollout())
    spec = SPECS[type(make_rollout())]
    read = read_fields(wire, spec)
    converted = fields_from_wire(wire, spec)
    assert read.keys() == converted.keys()
    for name, value in read.items():
        other = converted[name]
        assert (np.array_equal(value, other) and value.dtype == other.dtype) if isinstance(value, np.ndarray) \
            else value == other
    wire.pop("timings")
    with pytest.raises(SchemaError, match="timings: missing"):
        read_fields(wire, spec)


def test_decode_reports_an_embedded_field_and_a_missing_field():
    wire = message_to_wire(make_scored())
    wire["rollout"]["epoch"] = -1
    with pytest.raises(SchemaError, match=r"^invalid scored_rollout.rollout.epoch: must be >= 0, got -1$"):
        decode(msgpack.packb(wire, use_bin_type=True))
    wire = message_to_wire(make_scored())
    del wire["rollout"]["producer_id"]
    with pytest.raises(SchemaError, match=r"^invalid scored_rollout.rollout.producer_id: missing$"):
        decode(msgpack.packb(wire, use_bin_type=True))


@pytest.mark.parametrize("array", [
    np.arange(6, dtype=">i4"),  # big-endian: converted to little-endian bytes
    np.arange(12, dtype=np.float32)[::2],  # strided: written in C order
    np.arange(6, dtype=np.int64).reshape(2, 3).T,  # Fortran-ordered 2-D view
    np.array([1, 2, 3], np.uint8),
])
def test_encode_array_writes_little_endian_c_order_whatever_the_layout(array):
    wire = encode_array(array)
    assert wire["shape"] == list(array.shape)
    little = np.dtype(wire["dtype"])
    assert wire["data"] == np.ascontiguousarray(array, dtype=little).tobytes()
    back = decode_array(wire)
    assert back.flags.writeable and back.flags.c_contiguous and back.dtype.isnative
    assert np.array_equal(back, array)


def test_encode_validates_by_default():
    bad = make_rollout(behavior_logprobs=f32(-1, NAN, 0, 0))
    with pytest.raises(SchemaError, match="behavior_logprobs: contains NaN at index 1"):
        encode(bad)
