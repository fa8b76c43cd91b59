"""Declaring a wire structure once: each dataclass field names its wire type; the specs and registries derive.

Consumes: classes decorated with :func:`message` (a wire message, registered by its ``KIND``) or :func:`struct`
(a structure nested inside one, such as a tensor entry), every field made by :func:`wire`. Produces: the frozen,
keyword-only dataclass; its spec (:func:`spec_of`: ``(name, FieldType)`` pairs, field order = wire order); the
registries :data:`MESSAGE_TYPES` (kind -> class) and :data:`SPECS` (class -> spec); and the walk over a message
(``check_message``, ``message_to_wire``, ``message_from_wire``, ``read_envelope``, the :class:`Embedded` field).

Guarantees:
- One declaration per field: its Python type (the annotation), its wire type with bounds and checks (the
  :class:`~schemas.fields.FieldType` given to :func:`wire`), its default, and whether it was added after schema
  version 1 (``added=True``: absent on the wire reads as the field's default) sit on the field. Nothing else
  lists the fields.
- A field declared without :func:`wire`, an added field without a plain default, a message without ``KIND`` and
  a second class of the same ``KIND`` are refused when the class is defined: ``TypeError`` naming class and field.
- Messages compare field by field (arrays by dtype, shape and values) and are not hashable.
- Cross-field rules live in :mod:`schemas.validation`, which fills :data:`RULES` for every kind when the
  ``schemas`` package is imported (and refuses to import if a kind has none).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, ClassVar, TypeVar, dataclass_transform

import numpy as np

from schemas.errors import ROOT, SchemaError, wire_type_name
from schemas.fields import Added, FieldType, Float, Id, Int, Pattern
from schemas.ids import PROMPT_ID_MAX_LEN, SHA256_PATTERN, TOPIC_PATTERN
from schemas.spec import Spec, check_fields, fields_from_wire, fields_to_wire, read_fields

WIRE = "stream_rl.wire"
"""Key of a field's wire type in its ``dataclasses.Field.metadata``."""
ADDED = "stream_rl.wire_added"
"""Key of the "added after schema version 1" flag in a field's metadata."""

ID, PROMPT_ID, COUNT, TIME = Id(), Id(PROMPT_ID_MAX_LEN), Int(0), Float()
SHA256 = Pattern(SHA256_PATTERN, "sha256 hex digest")
TOPIC = Pattern(TOPIC_PATTERN, "topic name")
"""Field types several kinds share: any id, a prompt id, a count (int >= 0), a time, a digest, a topic name."""


def now() -> float:
    """The default of every ``created_at``: the time the message is built (``default_factory``, never import time)."""
    return time.time()


def wire(field_type: FieldType, *, default: Any = dataclasses.MISSING,
         default_factory: Callable[[], Any] | Any = dataclasses.MISSING, added: bool = False) -> Any:
    """A dataclass field whose wire type is ``field_type``; ``added``: added after schema version 1, so a record
    without it reads as ``default`` (which it must have). Without a default the field is required."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={WIRE: field_type, ADDED: added})


def _field_type(cls: type, field: dataclasses.Field) -> FieldType:
    where = f"{cls.__module__}.{cls.__qualname__}.{field.name}"
    field_type = field.metadata.get(WIRE)
    if not isinstance(field_type, FieldType):
        raise TypeError(f"{where} has no wire type: declare it as `{field.name}: T = wire(FieldType(...))`")
    if not field.metadata.get(ADDED):
        return field_type
    if field.default is dataclasses.MISSING:
        raise TypeError(f"{where} is an added field (added=True) without a default= to read when it is absent")
    return Added(field_type, field.default)


def _declare(cls: M, **options: bool) -> M:
    out: Any = dataclasses.dataclass(frozen=True, kw_only=True, **options)(cls)
    out.__wire_spec__ = tuple((f.name, _field_type(out, f)) for f in dataclasses.fields(out))
    return out


def spec_of(cls: type) -> Spec:
    """The ``(name, FieldType)`` pairs of a :func:`message` or :func:`struct` class, in field (= wire) order."""
    spec = cls.__dict__.get("__wire_spec__")
    if spec is None:
        raise TypeError(f"{cls.__qualname__} is not declared with @message or @struct")
    return spec


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool(np.array_equal(a, b)))
    return bool(a == b)


class Message:
    """Base of every wire message: a ``KIND`` string and a ``SCHEMA_VERSION``; equality field by field."""

    KIND: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 1

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_values_equal(getattr(self, f.name), getattr(other, f.name))
                   for f in dataclasses.fields(self))  # type: ignore[arg-type]

    __hash__ = None  # type: ignore[assignment]


M = TypeVar("M", bound=type)

MESSAGE_TYPES: dict[str, type[Message]] = {}
"""Registry: wire ``kind`` -> message class, in declaration order (filled by :func:`message`)."""
SPECS: dict[type[Message], Spec] = {}
"""Field specs by message class, derived from the declarations (filled by :func:`message`)."""
RULES: dict[type[Message], Callable[[Any], None]] = {}
"""Cross-field rule by message class, run after every field passed its own checks (filled by
:mod:`schemas.validation`)."""


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(wire,))
def message(cls: M) -> M:
    """Declare wire message ``cls`` (a :class:`Message` subclass with a ``KIND``): a frozen, keyword-only dataclass
    compared by :class:`Message`'s equality, its spec derived from its fields and registered under its kind."""
    if not (isinstance(cls, type) and issubclass(cls, Message) and cls.__dict__.get("KIND")):
        raise TypeError(f"{cls.__qualname__}: a message subclasses Message and declares its own KIND")
    if cls.KIND in MESSAGE_TYPES:
        raise TypeError(f"{cls.__qualname__}: kind {cls.KIND!r} is already {MESSAGE_TYPES[cls.KIND].__qualname__}")
    cls = _declare(cls, eq=False)
    MESSAGE_TYPES[cls.KIND], SPECS[cls] = cls, spec_of(cls)
    return cls


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(wire,))
def struct(cls: M) -> M:
    """Declare ``cls``, a structure nested in messages: a frozen, keyword-only dataclass with ``==``, its spec
    derived from its fields (:func:`spec_of`)."""
    return _declare(cls, eq=True)


def read_envelope(raw: Any) -> type[Message]:
    """The message class named by wire map ``raw``'s ``kind``, after checking ``schema_version``."""
    if not isinstance(raw, dict):
        raise SchemaError(ROOT, f"expected a msgpack map, got {wire_type_name(raw)}")
    if "kind" not in raw:
        raise SchemaError("kind", "missing")
    kind = raw["kind"]
    if not isinstance(kind, str):
        raise SchemaError("kind", f"expected str, got {wire_type_name(kind)}")
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise SchemaError("kind", f"unknown kind {kind!r:.80}; known: {', '.join(sorted(MESSAGE_TYPES))}")
    if "schema_version" not in raw:
        raise SchemaError("schema_version", "missing", kind)
    version = raw["schema_version"]
    if type(version) is not int:
        raise SchemaError("schema_version", f"expected int, got {wire_type_name(version)}", kind)
    if not 1 <= version <= cls.SCHEMA_VERSION:
        raise SchemaError("schema_version",
                          f"unsupported version {version}; this reader supports 1..{cls.SCHEMA_VERSION}", kind)
    return cls


def check_message(msg: Message) -> None:
    """Every field rule, then the cross-field rule of ``msg``'s kind."""
    cls = type(msg)
    spec = SPECS.get(cls)
    if spec is None:
        raise SchemaError(ROOT, f"expected a message, got {cls.__name__}")
    check_fields(msg, spec)
    RULES[cls](msg)


def message_to_wire(msg: Message) -> dict[str, Any]:
    """The wire map of a checked ``msg``: ``kind``, ``schema_version``, then the fields."""
    return {"kind": msg.KIND, "schema_version": msg.SCHEMA_VERSION, **fields_to_wire(msg, SPECS[type(msg)])}


def message_from_wire(raw: Any, cls: type[Message]) -> Message:
    """The message of class ``cls`` read from wire map ``raw`` (envelope already checked) and checked: each field
    converted and checked in one pass (``read_fields``), then the cross-field rule, as :func:`check_message`."""
    msg = cls(**read_fields(raw, SPECS[cls]))
    RULES[cls](msg)
    return msg


class Embedded(FieldType):
    """A whole message embedded as a field: the same map, envelope included, as its own record."""

    def __init__(self, cls: type[Message]) -> None:
        self.cls = cls

    def check(self, value: Any) -> None:
        if not isinstance(value, self.cls):
            raise SchemaError(ROOT, f"expected a {self.cls.KIND} message, got {type(value).__name__}")
        check_message(value)

    def to_wire(self, value: Any) -> dict[str, Any]:
        return message_to_wire(value)

    def _class_of(self, raw: Any) -> type[Message]:
        cls = read_envelope(raw)
        if cls is not self.cls:
            raise SchemaError("kind", f"expected {self.cls.KIND!r}, got {cls.KIND!r}")
        return cls

    def from_wire(self, raw: Any) -> Any:
        cls = self._class_of(raw)
        return cls(**fields_from_wire(raw, SPECS[cls]))

    def read(self, raw: Any) -> Any:
        return message_from_wire(raw, self._class_of(raw))
