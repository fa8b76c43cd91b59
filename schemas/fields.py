"""Field types: how one message field is checked, written to the wire and read back.

Consumes: Python values (``check``, ``to_wire``) or msgpack-decoded values (``from_wire``). Produces: plain
msgpack-able values, or Python values of the field's type.

Guarantees: ``check`` and ``from_wire`` raise :class:`SchemaError` whose ``field`` is relative to the field
(``"<root>"`` for the field itself, ``"dtype"`` or a map key below it); the functions of a whole structure
(:mod:`schemas.spec`) prefix the field name, so errors name the full dotted path.
``from_wire`` only converts (arrays, ints written for floats); every rule is enforced by ``check``, on the encode and
the decode side alike. ``read`` is ``from_wire`` then ``check`` in one pass (what decoding uses): it accepts and
rejects exactly what the two do, skipping only checks the conversion itself has proven (an array's dtype).
Python-side ints and floats may be numpy scalars; ``bool`` is never accepted as a number.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import numpy as np

from schemas.arrays import decode_array, encode_array
from schemas.errors import ROOT, SchemaError, wire_type_name
from schemas.ids import id_problem

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # the ufuncs themselves: ndarray.min() adds a Python wrapper


def _bad(reason: str) -> SchemaError:
    return SchemaError(ROOT, reason)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class FieldType:
    """Base: any value, sent as is."""

    def check(self, value: Any) -> None:
        """Raise :class:`SchemaError` when ``value`` is not allowed."""

    def to_wire(self, value: Any) -> Any:
        """The msgpack-able form of an already checked ``value``."""
        return value

    def from_wire(self, raw: Any) -> Any:
        """The Python form of decoded ``raw``; leaves anything unexpected for ``check`` to reject."""
        return raw

    def read(self, raw: Any) -> Any:
        """``check(from_wire(raw))``, returning the checked value."""
        value = self.from_wire(raw)
        self.check(value)
        return value


class Int(FieldType):
    """An int64 (>= ``minimum`` and <= ``maximum`` when given)."""

    def __init__(self, minimum: int | None = 0, maximum: int | None = None) -> None:
        self.minimum, self.maximum = minimum, maximum

    def check(self, value: Any) -> None:
        if type(value) is not int and not _is_int(value):
            raise _bad(f"expected int, got {wire_type_name(value)}")
        if not INT64_MIN <= int(value) <= INT64_MAX:
            raise _bad(f"{value} is outside the int64 range")
        if self.minimum is not None and value < self.minimum:
            raise _bad(f"must be >= {self.minimum}, got {value}")
        if self.maximum is not None and value > self.maximum:
            raise _bad(f"must be <= {self.maximum}, got {value}")

    def to_wire(self, value: Any) -> int:
        return int(value)


class Float(FieldType):
    """A finite float (> ``greater_than`` when given); an int on the wire is read as a float."""

    def __init__(self, greater_than: float | None = None) -> None:
        self.greater_than = greater_than

    def check(self, value: Any) -> None:
        if type(value) is not float and not (_is_int(value) or isinstance(value, (float, np.floating))):
            raise _bad(f"expected float, got {wire_type_name(value)}")
        if not math.isfinite(value):
            raise _bad(f"must be finite, got {float(value)}")
        if self.greater_than is not None and not value > self.greater_than:
            raise _bad(f"must be > {self.greater_than}, got {float(value)}")

    def to_wire(self, value: Any) -> float:
        return float(value)

    def from_wire(self, raw: Any) -> Any:
        return float(raw) if type(raw) is int else raw


class Bool(FieldType):
    """A msgpack boolean."""

    def check(self, value: Any) -> None:
        if not isinstance(value, (bool, np.bool_)):
            raise _bad(f"expected bool, got {wire_type_name(value)}")

    def to_wire(self, value: Any) -> bool:
        return bool(value)


class Str(FieldType):
    """A UTF-8 string (non-empty when ``nonempty``)."""

    def __init__(self, nonempty: bool = False) -> None:
        self.nonempty = nonempty

    def check(self, value: Any) -> None:
        if not isinstance(value, str):
            raise _bad(f"expected str, got {wire_type_name(value)}")
        if self.nonempty and not value:
            raise _bad("must not be empty")


class Id(FieldType):
    """A string matching ``ID_PATTERN`` and at most ``max_len`` characters."""

    def __init__(self, max_len: int = 255) -> None:
        self.max_len = max_len

    def check(self, value: Any) -> None:
        problem = id_problem(value, self.max_len)
        if problem is not None:
            raise _bad(problem)


class Pattern(FieldType):
    """A string matching ``pattern`` (topic names, hex digests)."""

    def __init__(self, pattern: re.Pattern[str], what: str) -> None:
        self.pattern, self.what = pattern, what

    def check(self, value: Any) -> None:
        if not isinstance(value, str):
            raise _bad(f"expected str, got {wire_type_name(value)}")
        if not self.pattern.fullmatch(value):
            raise _bad(f"malformed {self.what} {value[:80]!r} (must match {self.pattern.pattern})")


class Enum(FieldType):
    """One string out of ``choices``."""

    def __init__(self, choices: Sequence[str]) -> None:
        self.choices = tuple(choices)

    def check(self, value: Any) -> None:
        if not isinstance(value, str) or value not in self.choices:
            raise _bad(f"must be one of {', '.join(map(repr, self.choices))}, got {value!r:.80}")


class Bytes(FieldType):
    """Raw bytes, msgpack bin (non-empty when ``nonempty``)."""

    def __init__(self, nonempty: bool = False) -> None:
        self.nonempty = nonempty

    def check(self, value: Any) -> None:
        if not isinstance(value, (bytes, bytearray)):
            raise _bad(f"expected bin, got {wire_type_name(value)}")
        if self.nonempty and not value:
            raise _bad("must not be empty")

    def to_wire(self, value: Any) -> bytes:
        return bytes(value)


class Shape(FieldType):
    """A list of non-negative ints (a tuple or list in Python)."""

    def check(self, value: Any) -> None:
        if not isinstance(value, (list, tuple)) or not all(_is_int(d) and d >= 0 for d in value):
            raise _bad(f"expected an array of non-negative ints, got {value!r:.80}")

    def to_wire(self, value: Any) -> list[int]:
        return [int(d) for d in value]


class StrList(FieldType):
    """A list of non-empty strings."""

    def check(self, value: Any) -> None:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise _bad(f"expected an array of non-empty strings, got {value!r:.80}")

    def to_wire(self, value: Any) -> list[str]:
        return [str(v) for v in value]

    def from_wire(self, raw: Any) -> Any:
        return list(raw) if isinstance(raw, (list, tuple)) else raw


class MapList(FieldType):
    """A list of ``StrMap`` values (e.g. one tag map per turn); an error names the index (``turns.1.role``)."""

    def __init__(self, item: StrMap) -> None:
        self.item = item

    def check(self, value: Any) -> None:
        if not isinstance(value, (list, tuple)):
            raise _bad(f"expected an array of maps, got {wire_type_name(value)}")
        for index, item in enumerate(value):
            try:
                self.item.check(item)
            except SchemaError as exc:
                raise exc.nested(str(index)) from None

    def to_wire(self, value: Any) -> list[Any]:
        return [self.item.to_wire(item) for item in value]

    def from_wire(self, raw: Any) -> Any:
        return [self.item.from_wire(item) for item in raw] if isinstance(raw, (list, tuple)) else raw


class Added(FieldType):
    """A field added to a kind after schema version 1: ``inner`` on the wire, ``default`` when the key is absent.

    Records written before the field existed stay readable (docs/wire-format.md section 9); writers always
    write it."""

    def __init__(self, inner: FieldType, default: Any) -> None:
        self.inner, self.default = inner, default

    def check(self, value: Any) -> None:
        self.inner.check(value)

    def to_wire(self, value: Any) -> Any:
        return self.inner.to_wire(value)

    def from_wire(self, raw: Any) -> Any:
        return self.inner.from_wire(raw)

    def read(self, raw: Any) -> Any:
        return self.inner.read(raw)


class Optional(FieldType):
    """``inner`` or nil."""

    def __init__(self, inner: FieldType) -> None:
        self.inner = inner

    def check(self, value: Any) -> None:
        if value is not None:
            self.inner.check(value)

    def to_wire(self, value: Any) -> Any:
        return None if value is None else self.inner.to_wire(value)

    def from_wire(self, raw: Any) -> Any:
        return None if raw is None else self.inner.from_wire(raw)

    def read(self, raw: Any) -> Any:
        return None if raw is None else self.inner.read(raw)


class StrMap(FieldType):
    """A map from strings to ``values``; an error names the key (``metadata.source``)."""

    def __init__(self, values: FieldType) -> None:
        self.values = values

    def check(self, value: Any) -> None:
        if not isinstance(value, dict):
            raise _bad(f"expected map, got {wire_type_name(value)}")
        for key, item in value.items():
            if not isinstance(key, str):
                raise _bad(f"keys must be str, got {wire_type_name(key)} {key!r:.80}")
            try:
                self.values.check(item)
            except SchemaError as exc:
                raise exc.nested(key) from None

    def to_wire(self, value: Any) -> dict[str, Any]:
        return {key: self.values.to_wire(item) for key, item in value.items()}

    def from_wire(self, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        return {key: self.values.from_wire(item) for key, item in raw.items()}


class Array(FieldType):
    """A 1-D numpy array of one wire dtype, at least ``min_len`` long, with optional value bounds.

    Values are checked in one fused pass: the array's minimum and maximum (NaN propagates through both, and an
    inf is one of them) prove every value rule at once with at most two reductions, whatever the number of rules.
    Only an array they do not clear is scanned rule by rule, which names the first offending element; that scan is
    the authority, so the fused pass can only be faster, never more or less strict."""

    def __init__(self, dtype: str, *, min_len: int = 0, finite: bool = False,
                 minimum: float | None = None, maximum: float | None = None) -> None:
        self.dtype, self.min_len, self.finite = dtype, min_len, finite
        self.minimum, self.maximum = minimum, maximum
        self._expected: Any = np.dtype(dtype)
        self._needs_min = finite or minimum is not None
        self._needs_max = finite or maximum is not None

    def check(self, value: Any) -> None:
        expected = self._expected
        if not isinstance(value, np.ndarray):
            raise _bad(f"expected numpy.ndarray of {expected.name}, got {wire_type_name(value)}")
        if value.dtype.kind != expected.kind or value.dtype.itemsize != expected.itemsize:
            raise _bad(f"expected dtype {expected.name} ({self.dtype}), got {value.dtype.name}")
        self._check_shape_and_values(value)

    def _check_shape_and_values(self, value: np.ndarray) -> None:
        if value.ndim != 1:
            raise _bad(f"expected a 1-D array, got shape {list(value.shape)}")
        if value.shape[0] < self.min_len:
            raise _bad(f"expected at least {self.min_len} element(s), got {value.shape[0]}")
        if not self._values_clear(value):
            self._check_values(value)

    def _values_clear(self, value: np.ndarray) -> bool:
        """True when the fused pass proves every value rule holds; False means "scan rule by rule"."""
        if value.shape[0] == 0:
            return True
        low = _MIN(value) if self._needs_min else math.nan  # NaN: never read (the rules below need no minimum)
        high = _MAX(value) if self._needs_max else math.nan
        # Every comparison with NaN is False, and a NaN anywhere makes the min and the max NaN: never cleared.
        if self.finite and not (-math.inf < low and high < math.inf):
            return False
        if self.minimum is not None and not low >= self.minimum:
            return False
        return self.maximum is None or bool(high <= self.maximum)

    def _check_values(self, value: np.ndarray) -> None:
        if self.finite:
            for name, mask in (("NaN", np.isnan(value)), ("inf", np.isinf(value))):
                if mask.any():
                    raise _bad(f"contains {name} at index {int(np.argmax(mask))}")
        for bound, mask, relation in ((self.minimum, lambda b: value < b, ">="),
                                      (self.maximum, lambda b: value > b, "<=")):
            if bound is not None and (hit := mask(bound)).any():
                index = int(np.argmax(hit))
                raise _bad(f"contains {value[index].item()!r} at index {index}; values must be {relation} {bound}")

    def to_wire(self, value: Any) -> dict[str, Any]:
        return encode_array(value)

    def from_wire(self, raw: Any) -> np.ndarray:
        array = decode_array(raw)
        if raw["dtype"] != self.dtype:
            raise SchemaError("dtype", f"expected {self.dtype!r} ({self._expected.name}), got {raw['dtype']!r}")
        return array

    def read(self, raw: Any) -> np.ndarray:
        array = self.from_wire(raw)  # an ndarray of exactly this field's dtype, or SchemaError
        self._check_shape_and_values(array)
        return array
