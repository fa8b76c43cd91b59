"""Typed little-endian array encoding: ``numpy.ndarray`` <-> msgpack map ``{dtype, shape, data}``.

Consumes: numpy arrays of a fixed-width integer or IEEE float dtype (encode), or the msgpack-decoded map (decode).
Produces: the wire map ``{"dtype": "<f4", "shape": [n, ...], "data": <bin>}`` (encode), or a new writable,
C-contiguous, native-byte-order ndarray (decode).

Guarantees:
- ``dtype`` is spelled as a numpy array-interface type string with explicit byte order: ``<`` little-endian
  (``|`` for one-byte types), a kind letter (``i`` signed int, ``u`` unsigned int, ``f`` IEEE-754 float) and the
  item size in bytes; only the spellings in :data:`WIRE_DTYPES` are written or accepted.
- ``data`` is exactly ``prod(shape) * itemsize`` bytes, little-endian, C (row-major) order, whatever the byte order
  or memory layout of the array that was encoded. No pickle, no object arrays.
- Decoding checks every key and raises :class:`SchemaError` whose ``field`` is the offending key (``"dtype"``,
  ``"shape"``, ``"data"``) or ``"<root>"``; callers nest it under the message field name. Unknown extra keys in the
  map are ignored (forward compatibility).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from schemas.errors import ROOT, SchemaError, wire_type_name

WIRE_DTYPES: tuple[str, ...] = (
    "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8",
)
"""Every dtype spelling allowed on the wire."""
_DTYPES: dict[str, np.dtype] = {spelled: np.dtype(spelled) for spelled in WIRE_DTYPES}
_NATIVE: dict[str, np.dtype] = {spelled: dt.newbyteorder("=") for spelled, dt in _DTYPES.items()}
_SPELLED: dict[np.dtype, str] = {}
"""Wire spelling of each array dtype seen so far (filled by :func:`encode_array`; at most a few dozen entries)."""


def wire_dtype(dtype: Any) -> str:
    """The wire spelling of a numpy dtype (``np.int32`` -> ``"<i4"``, ``np.uint8`` -> ``"|u1"``)."""
    dt = np.dtype(dtype)
    spelled = dt.newbyteorder("<").str
    if dt.kind not in "iuf" or spelled not in WIRE_DTYPES:
        raise SchemaError("dtype", f"dtype {dt} cannot be sent; allowed: {', '.join(WIRE_DTYPES)}")
    return spelled


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """The wire map of ``array``: dtype spelling, shape as a list, little-endian C-order bytes."""
    if not isinstance(array, np.ndarray):
        raise SchemaError(ROOT, f"expected numpy.ndarray, got {wire_type_name(array)}")
    dt = array.dtype
    spelled = _SPELLED.get(dt)
    if spelled is None:
        spelled = _SPELLED[dt] = wire_dtype(dt)
    # tobytes() writes C order whatever the layout; only another byte order needs a converted copy first
    data = array.tobytes() if dt.str == spelled else array.astype(_DTYPES[spelled]).tobytes()
    return {"dtype": spelled, "shape": list(array.shape), "data": data}


def _element_count(shape: Any) -> int:
    if type(shape) is list and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0:
        return shape[0]  # the 1-D arrays of every per-token field, without the general loop below
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SchemaError("shape", f"expected an array of non-negative ints, got {shape!r:.80}")
    return math.prod(shape)


def decode_array(obj: Any) -> np.ndarray:
    """The array carried by wire map ``obj``; raises :class:`SchemaError` naming the bad key."""
    if not isinstance(obj, dict):
        raise SchemaError(ROOT, f"expected an array map {{dtype, shape, data}}, got {wire_type_name(obj)}")
    for key in ("dtype", "shape", "data"):
        if key not in obj:
            raise SchemaError(key, "missing")
    spelled, shape, data = obj["dtype"], obj["shape"], obj["data"]
    dt = _DTYPES.get(spelled) if isinstance(spelled, str) else None
    if dt is None:
        raise SchemaError("dtype", f"unsupported dtype {spelled!r:.40}; allowed: {', '.join(WIRE_DTYPES)}")
    count = _element_count(shape)
    if not isinstance(data, bytes):
        raise SchemaError("data", f"expected bin, got {wire_type_name(data)}")
    expected = count * dt.itemsize
    if len(data) != expected:
        raise SchemaError("data", f"{len(data)} bytes for shape {shape} of {spelled}, expected {expected}")
    wire = np.frombuffer(data, dtype=dt)  # read-only, over the record's bytes
    native = wire.copy() if dt.isnative else wire.astype(_NATIVE[spelled])
    return native if len(shape) == 1 else native.reshape(shape)
