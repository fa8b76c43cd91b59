"""The wire schemas without a broker: round trips, the raw layout, every validation rule, ids, manifests."""

from __future__ import annotations

import base64
import dataclasses
import pickle

import msgpack
import numpy as np
import pytest
from support.messages import (
    DROP,
    MAKERS,
    make_alert,
    make_dead_letter,
    make_heartbeat,
    make_manifest,
    make_member_rejected,
    make_rollout,
    make_scored,
    rewrite,
)

from schemas import (
    ID_PATTERN,
    MESSAGE_TYPES,
    Prompt,
    SchemaError,
    decode,
    decode_array,
    encode,
    encode_array,
    group_id_for,
    message_kind,
    rollout_id_for,
    to_jsonable,
    validate,
    wire_dtype,
)
from schemas.fields import Added
from schemas.validation import SPECS


def test_member_rejected_names_a_group_and_its_rollout_or_only_the_group():
    import dataclasses as dc
    undecoded = dc.replace(make_member_rejected(), rollout_id=None, attempt=None)
    assert decode(encode(undecoded)) == undecoded  # a record that did not decode: its key names the group
    for bad, field, says in (
            (dc.replace(make_member_rejected(), group_id="p0"), "member_rejected.group_id", "<prompt_id>:<epoch>"),
            (dc.replace(make_member_rejected(), group_id="p0:01"), "member_rejected.group_id", "<epoch>"),
            (dc.replace(make_member_rejected(), attempt=None), "member_rejected.attempt", "both set"),
            (dc.replace(undecoded, attempt=0), "member_rejected.attempt", "both nil"),
            (dc.replace(make_member_rejected(), rollout_id="p1:1:2"), "member_rejected.rollout_id", "p0:1:<i>"),
            (dc.replace(make_member_rejected(), reason=""), "member_rejected.reason", "")):
        with pytest.raises(SchemaError, match=field.replace(".", r"\.")) as info:
            encode(bad)
        assert says in str(info.value)








def test_heartbeat_and_alert_reject_unknown_role_state_and_action():
    import dataclasses as dc
    for bad, field in ((dc.replace(make_heartbeat(), role="worker"), "heartbeat.role"),
                       (dc.replace(make_heartbeat(), policy_version=-2), "heartbeat.policy_version"),
                       (dc.replace(make_heartbeat(), open_alerts=[""]), "heartbeat.open_alerts"),
                       (dc.replace(make_alert(), action="page"), "alert.action"),
                       (dc.replace(make_alert(), value=float("nan")), "alert.value")):
        with pytest.raises(SchemaError, match=field.replace(".", r"\.")):
            encode(bad)


def assert_same_value(got, want, where: str) -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, where
        assert got.shape == want.shape and np.array_equal(got, want), where
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want), where
        for f in dataclasses.fields(want):
            assert_same_value(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_value(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_every_kind_round_trips_field_by_field(kind):
    msg = MAKERS[kind]()
    got = decode(encode(msg))
    assert_same_value(got, msg, kind)
    assert got == msg and got.KIND == kind == message_kind(encode(msg))


def test_equality_sees_array_values_and_dtypes():
    base = make_rollout()
    assert base == make_rollout()
    assert base != make_rollout(behavior_logprobs=np.array([-0.25, -1.5, 0.0, -3.5], np.float32))
    assert base != make_rollout(token_policy_versions=np.array([6, 5, 6, 6], np.int32))


def test_registry_and_specs_cover_every_dataclass_field_in_order():
    assert sorted(MESSAGE_TYPES) == sorted(MAKERS)
    for kind, cls in MESSAGE_TYPES.items():
        assert cls.KIND == kind and cls.SCHEMA_VERSION == 1
        assert [name for name, _ in SPECS[cls]] == [f.name for f in dataclasses.fields(cls)]


def test_raw_map_has_envelope_first_and_little_endian_typed_arrays():
    msg = make_rollout()
    raw = msgpack.unpackb(encode(msg), raw=False)
    assert list(raw)[:2] == ["kind", "schema_version"] and raw["kind"] == "rollout" and raw["schema_version"] == 1
    assert raw["response_token_ids"] == {"dtype": "<i4", "shape": [4], "data": bytes.fromhex(
        "01000000" "00010000" "00000100" "03000000")}
    assert raw["behavior_logprobs"]["dtype"] == "<f4"
    assert raw["behavior_logprobs"]["data"] == np.array([-0.25, -1.5, 0.0, -3.0], "<f4").tobytes()
    assert raw["token_policy_versions"]["dtype"] == "<i8"
    assert raw["token_policy_versions"]["data"][:8] == b"\x06" + b"\x00" * 7
    assert isinstance(raw["rollout_id"], str) and raw["answer"] == "4"


def test_big_endian_and_strided_arrays_are_written_little_endian_c_order():
    swapped = np.array([1, 256, 65536, 3], ">i4")
    raw = msgpack.unpackb(encode(make_rollout(response_token_ids=swapped)), raw=False)
    assert raw["response_token_ids"]["data"] == np.array([1, 256, 65536, 3], "<i4").tobytes()
    grid = np.arange(6, dtype=np.int16).reshape(2, 3).T  # (3, 2), Fortran-ordered view
    wire = encode_array(grid)
    assert wire["dtype"] == "<i2" and wire["shape"] == [3, 2]
    assert wire["data"] == np.array([0, 3, 1, 4, 2, 5], "<i2").tobytes()
    back = decode_array(wire)
    assert np.array_equal(back, grid) and back.flags.writeable and back.dtype == np.int16


def test_a_1024_token_rollout_is_compact():
    n = 1024
    msg = make_rollout(response_token_ids=np.arange(n, dtype=np.int32) * 40,
                       behavior_logprobs=np.linspace(-5, 0, n, dtype=np.float32),
                       token_policy_versions=np.full(n, 6, np.int64))
    data = encode(msg)
    raw = msgpack.unpackb(data, raw=False)
    sizes = [len(raw[name]["data"]) for name in ("response_token_ids", "behavior_logprobs", "token_policy_versions")]
    assert sizes == [4 * n, 4 * n, 8 * n]
    assert len(data) <= sum(sizes) + 800  # field names, texts and small fields: well under a kilobyte


def test_defaults_are_fresh_per_message(monkeypatch):
    monkeypatch.setattr("schemas.declare.time.time", lambda: 123.5)
    one, two = Prompt(prompt_id="a", epoch=0, text="t", group_size=1), Prompt(prompt_id="b", epoch=0, text="t",
                                                                              group_size=1)
    assert one.created_at == 123.5 and one.metadata == {} and one.metadata is not two.metadata
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.epoch = 1  # type: ignore[misc]


def test_rollout_properties():
    msg = make_rollout()
    assert (msg.min_policy_version, msg.max_policy_version, msg.response_length) == (5, 6, 4)
    scored = make_scored()
    assert (scored.rollout_id, scored.group_id) == ("p0:1:2", "p0:1")


# --- deterministic ids -------------------------------------------------------------------------------------

def test_ids_are_deterministic_and_ignore_the_attempt():
    assert group_id_for("p0", 1) == "p0:1" and rollout_id_for("p0", 1, 2) == "p0:1:2"
    first, regenerated = make_rollout(attempt=0), make_rollout(attempt=3, producer_id="producer-9")
    assert regenerated.rollout_id == first.rollout_id and regenerated.group_id == first.group_id
    assert decode(encode(regenerated)).rollout_id == "p0:1:2"


def test_ids_are_injective_and_well_formed_at_the_limits():
    triples = [("a", 1, 23), ("a", 12, 3), ("a:1", 2, 3), ("a", 1, 2), ("a:1:2", 0, 0), ("a", 0, 0)]
    assert len({rollout_id_for(*t) for t in triples}) == len(triples)
    longest = rollout_id_for("p" * 200, 2**63 - 1, 2**63 - 1)
    assert ID_PATTERN.fullmatch(longest) and ID_PATTERN.fullmatch(group_id_for("x.y/z@w-1", 0))


@pytest.mark.parametrize("args, field", [(("", 0, 0), "prompt_id"), (("p" * 201, 0, 0), "prompt_id"),
                                         (("a b", 0, 0), "prompt_id"), (("p", -1, 0), "epoch"),
                                         (("p", 0, -1), "sample_index"), (("p", True, 0), "epoch")])
def test_id_helpers_reject_bad_parts(args, field):
    with pytest.raises(SchemaError) as info:
        rollout_id_for(*args)
    assert info.value.field == field


# --- whole-record errors -----------------------------------------------------------------------------------

GOOD = encode(make_rollout())


@pytest.mark.parametrize("data, reason, peek_sees_it", [
    (b"", "not valid msgpack", True), (b"\xc1", "not valid msgpack", True),
    (GOOD[:-3], "not valid msgpack", False), (GOOD + b"\x00", "not valid msgpack", False),
    (b"\x81\xa4kind\xa2\xff\xfe", "not valid msgpack", True),
    (msgpack.packb([1, 2]), "expected a msgpack map", True), (msgpack.packb(3), "expected a msgpack map", True),
    (None, "expected bytes", True), ("a str", "expected bytes", True),
])
def test_garbage_is_rejected_at_the_root(data, reason, peek_sees_it):
    for read in (decode, message_kind) if peek_sees_it else (decode,):
        with pytest.raises(SchemaError) as info:
            read(data)
        assert info.value.field == "<root>" and reason in info.value.reason
        assert str(info.value).startswith("invalid message: ")






@pytest.mark.parametrize("changes, field, reason", [
    ({"kind": DROP}, "kind", "missing"), ({"kind": 7}, "kind", "expected str"),
    ({"kind": "rollouts"}, "kind", "unknown kind"), ({"schema_version": DROP}, "schema_version", "missing"),
    ({"schema_version": 2}, "schema_version", "unsupported version 2"),
    ({"schema_version": 0}, "schema_version", "unsupported"), ({"schema_version": -1}, "schema_version", "unsupported"),
    ({"schema_version": "1"}, "schema_version", "expected int"),
    ({"schema_version": True}, "schema_version", "expected int"),
])
def test_envelope_errors_name_kind_or_schema_version(changes, field, reason):
    with pytest.raises(SchemaError) as info:
        decode(rewrite(GOOD, **changes))
    assert info.value.field == field and reason in info.value.reason


def test_expected_kind_is_enforced_before_the_fields():
    bad_rollout = rewrite(GOOD, epoch=-1)
    with pytest.raises(SchemaError) as info:
        decode(bad_rollout, expected_kind="prompt")
    assert info.value.field == "kind" and "expected 'prompt'" in info.value.reason
    assert decode(GOOD, expected_kind=("prompt", "rollout")).KIND == "rollout"


def test_message_kind_peeks_without_field_checks_and_finds_kind_anywhere():
    assert message_kind(rewrite(GOOD, epoch=-1)) == "rollout"
    assert message_kind(msgpack.packb({"x": [1, {"y": b"z"}], "kind": "prompt"}, use_bin_type=True)) == "prompt"
    for data, field in ((msgpack.packb({"x": 1}), "kind"), (msgpack.packb({"kind": "nope"}), "kind")):
        with pytest.raises(SchemaError) as info:
            message_kind(data)
        assert info.value.field == field


def test_unknown_fields_are_ignored_everywhere():
    scored = make_scored()
    raw = msgpack.unpackb(encode(scored), raw=False)
    raw["future_field"] = {"a": [1, 2]}
    raw["rollout"]["future_flag"] = True
    raw["token_rewards"]["byte_order_note"] = "le"
    assert decode(msgpack.packb(raw, use_bin_type=True)) == scored
    payload, manifest = make_manifest()
    raw = msgpack.unpackb(encode(manifest), raw=False)
    raw["tensors"][0]["quantization"] = None
    assert decode(msgpack.packb(raw, use_bin_type=True)) == manifest


@pytest.mark.parametrize("cls", sorted(SPECS, key=lambda c: c.KIND), ids=lambda c: c.KIND)
def test_every_missing_field_is_named(cls):
    data = encode(MAKERS[cls.KIND]())
    for name, field_type in SPECS[cls]:
        if isinstance(field_type, Added):  # added after version 1: older records lack it, read as its default
            assert getattr(decode(rewrite(data, **{name: DROP})), name) == field_type.default
            continue
        with pytest.raises(SchemaError) as info:
            decode(rewrite(data, **{name: DROP}))
        assert (info.value.field, info.value.reason, info.value.kind) == (name, "missing", cls.KIND)


def test_error_message_format_and_pickling():
    with pytest.raises(SchemaError) as info:
        encode(make_rollout(behavior_logprobs=np.array([-1, np.nan, 0, 0], np.float32)))
    err = info.value
    assert isinstance(err, ValueError)
    assert str(err) == "invalid rollout.behavior_logprobs: contains NaN at index 1"
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.field, copy.reason, copy.kind, str(copy)) == (err.field, err.reason, err.kind, str(err))
    with pytest.raises(SchemaError) as info:
        encode("not a message")  # type: ignore[arg-type]
    assert info.value.field == "<root>"


def test_validate_returns_the_message_and_to_jsonable_matches_the_wire():
    msg = make_dead_letter()
    assert validate(msg) is msg
    view = to_jsonable(msg)
    assert base64.b64decode(view["raw_value"]) == b"\xc1garbage" and base64.b64decode(view["raw_key"]) == b"p0:1"
    assert view["kind"] == "dead_letter" and view["source_offset"] == 41
    rollout_view = to_jsonable(make_rollout())
    assert rollout_view["behavior_logprobs"] == [-0.25, -1.5, 0.0, -3.0]
    assert rollout_view["response_token_ids"] == [1, 256, 65536, 3]


@pytest.mark.parametrize("dtype, spelled", [(np.int32, "<i4"), (np.int64, "<i8"), (np.float32, "<f4"),
                                            (np.float16, "<f2"), (np.uint8, "|u1"), (">f8", "<f8")])
def test_wire_dtype_spelling(dtype, spelled):
    assert wire_dtype(dtype) == spelled


@pytest.mark.parametrize("dtype", [np.bool_, np.complex64, object, "U3"])
def test_unsendable_dtypes_are_refused(dtype):
    with pytest.raises(SchemaError) as info:
        encode_array(np.zeros(2, dtype=dtype))
    assert info.value.field == "dtype"
