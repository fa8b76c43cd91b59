"""Each wire field is declared once, on its dataclass: what is derived from the declarations, and what is refused."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import msgpack
import pytest

from schemas import MESSAGE_TYPES, SchemaError, decode, encode
from schemas.declare import COUNT, RULES, SPECS, Message, message, spec_of, struct, wire
from schemas.fields import Added, Bool, FieldType, Int, Optional, Str
from schemas.validation import require_a_rule_per_kind


@pytest.fixture
def probe_kind():
    """Undo the registration of any message a test declares (kind ``probe``)."""
    yield "probe"
    cls = MESSAGE_TYPES.pop("probe", None)
    SPECS.pop(cls, None)
    RULES.pop(cls, None)


def test_a_field_without_a_wire_type_is_refused_when_the_class_is_defined(probe_kind):
    with pytest.raises(TypeError, match=r"Probe\.count has no wire type: declare it as `count: T = wire\("):
        @message
        class Probe(Message):
            KIND: ClassVar[str] = probe_kind
            name: str = wire(Str())
            count: int
    with pytest.raises(TypeError, match=r"PlainField\.flag has no wire type"):
        @message
        class PlainField(Message):
            KIND: ClassVar[str] = probe_kind
            flag: bool = dataclasses.field(default=False)  # a plain field: no wire type
    assert probe_kind not in MESSAGE_TYPES
    with pytest.raises(TypeError, match=r"Entry\.size has no wire type"):
        @struct
        class Entry:
            size: int = 0


def test_an_added_field_needs_a_default_to_read_when_absent(probe_kind):
    with pytest.raises(TypeError, match=r"Probe\.note is an added field \(added=True\) without a default="):
        @message
        class Probe(Message):
            KIND: ClassVar[str] = probe_kind
            note: str | None = wire(Optional(Str()), added=True)


def test_a_kind_is_declared_by_one_message_class(probe_kind):
    with pytest.raises(TypeError, match=r"Rollout2: kind 'rollout' is already Rollout"):
        @message
        class Rollout2(Message):
            KIND: ClassVar[str] = "rollout"
            x: int = wire(COUNT)
    with pytest.raises(TypeError, match=r"NoKind: a message subclasses Message and declares its own KIND"):
        @message
        class NoKind(Message):
            x: int = wire(COUNT)
    with pytest.raises(TypeError, match=r"NotAMessage: a message subclasses Message"):
        @message
        class NotAMessage:
            KIND: ClassVar[str] = probe_kind
    assert MESSAGE_TYPES["rollout"].__name__ == "Rollout" and probe_kind not in MESSAGE_TYPES


def test_the_spec_is_derived_from_the_fields_in_order_with_added_defaults(probe_kind):
    bounded = Int(1, 9)

    @message
    class Probe(Message):
        KIND: ClassVar[str] = probe_kind
        count: int = wire(bounded)
        label: str = wire(Str(nonempty=True), default="x")
        late: bool = wire(Bool(), default=True, added=True)

    spec = spec_of(Probe)
    assert [name for name, _ in spec] == ["count", "label", "late"] and spec is SPECS[Probe]
    assert spec[0][1] is bounded and isinstance(spec[1][1], Str) and spec[1][1].nonempty
    assert isinstance(spec[2][1], Added) and isinstance(spec[2][1].inner, Bool) and spec[2][1].default is True
    assert MESSAGE_TYPES[probe_kind] is Probe
    probe = Probe(count=3)
    assert dataclasses.is_dataclass(probe) and probe == Probe(count=3) and probe != Probe(count=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        probe.count = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        Probe(3)  # type: ignore[misc]  # keyword-only


def test_a_new_kind_is_one_declaration_and_one_rule(probe_kind):
    """Declared and given a rule, a new kind is encoded in field order, decoded, and its bounds enforced."""

    @message
    class Probe(Message):
        KIND: ClassVar[str] = probe_kind
        count: int = wire(Int(1, 9))
        late: bool = wire(Bool(), default=True, added=True)

    with pytest.raises(TypeError, match=r"no cross-field rule for \S*\.Probe: add it to schemas\.validation\.RULES"):
        require_a_rule_per_kind()
    RULES[Probe] = lambda msg: None
    require_a_rule_per_kind()
    data = encode(Probe(count=3, late=False))
    assert msgpack.unpackb(data) == {"kind": "probe", "schema_version": 1, "count": 3, "late": False}
    assert list(msgpack.unpackb(data)) == ["kind", "schema_version", "count", "late"]
    assert decode(data) == Probe(count=3, late=False)
    assert decode(msgpack.packb({"kind": "probe", "schema_version": 1, "count": 2})) == Probe(count=2, late=True)
    with pytest.raises(SchemaError, match=r"^invalid probe\.count: must be <= 9, got 10$"):
        encode(Probe(count=10))
    with pytest.raises(SchemaError, match=r"^invalid probe\.count: missing$"):
        decode(msgpack.packb({"kind": "probe", "schema_version": 1}))


def test_every_shipped_field_carries_its_wire_type_on_the_dataclass():
    """The shipped kinds: each spec entry is the very FieldType declared on the field (no second list)."""
    for cls in MESSAGE_TYPES.values():
        for f, (name, field_type) in zip(dataclasses.fields(cls), SPECS[cls], strict=True):
            declared = f.metadata["stream_rl.wire"]
            assert name == f.name and isinstance(declared, FieldType)
            assert field_type is declared or (isinstance(field_type, Added) and field_type.inner is declared
                                               and field_type.default == f.default), f"{cls.__name__}.{name}"
