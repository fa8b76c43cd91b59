"""A structure's fields as one ordered spec: check, write and read every field of a message or a nested entry.

Consumes: a :data:`Spec` (ordered ``(field name, FieldType)`` pairs, :mod:`schemas.fields`) with an object whose
attributes are the fields (``check_fields``, ``fields_to_wire``) or a decoded wire map (``read_fields``,
``fields_from_wire``).
Produces: nothing (a check), the wire map in spec order, or the constructor keyword arguments.
Guarantees: every error is a :class:`SchemaError` whose ``field`` is prefixed with the field name, so it names the
full dotted path (``metadata.source``); a field missing from the wire map is an error unless it is
:class:`~schemas.fields.Added`, which then takes its default; keys not in the spec are ignored. ``read_fields``
accepts and rejects exactly what ``fields_from_wire`` then ``check_fields`` do, in one pass.
"""

from __future__ import annotations

from typing import Any, Sequence

from schemas.errors import ROOT, SchemaError
from schemas.fields import Added, FieldType

Spec = Sequence[tuple[str, FieldType]]
"""Ordered (field name, field type) pairs of one structure; the order is the wire order."""


def check_fields(obj: Any, spec: Spec) -> None:
    """Check every field of ``obj`` against ``spec``; errors name the field."""
    for name, field_type in spec:
        try:
            field_type.check(getattr(obj, name))
        except SchemaError as exc:
            raise exc.nested(name) from None


def fields_to_wire(obj: Any, spec: Spec) -> dict[str, Any]:
    """The wire map of ``obj``'s fields, in spec order."""
    return {name: field_type.to_wire(getattr(obj, name)) for name, field_type in spec}


def read_fields(raw: dict[str, Any], spec: Spec) -> dict[str, Any]:
    """Checked constructor keyword arguments read from wire map ``raw``: each field converted and checked in one
    pass (``read``); required and defaulted fields as in :func:`fields_from_wire`, extra keys ignored."""
    kwargs = {}
    for name, field_type in spec:
        try:
            if name in raw:
                kwargs[name] = field_type.read(raw[name])
            elif isinstance(field_type, Added):
                kwargs[name] = field_type.read(field_type.default)
            else:
                raise SchemaError(ROOT, "missing")
        except SchemaError as exc:
            raise exc.nested(name) from None
    return kwargs


def fields_from_wire(raw: dict[str, Any], spec: Spec) -> dict[str, Any]:
    """Constructor keyword arguments read from wire map ``raw``; every spec field is required (an :class:`Added`
    one takes its default when absent), extra keys are ignored."""
    kwargs = {}
    for name, field_type in spec:
        if name not in raw:
            if isinstance(field_type, Added):
                kwargs[name] = field_type.default
                continue
            raise SchemaError(name, "missing")
        try:
            kwargs[name] = field_type.from_wire(raw[name])
        except SchemaError as exc:
            raise exc.nested(name) from None
    return kwargs
