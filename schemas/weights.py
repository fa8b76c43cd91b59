"""The weights messages: a version's manifest, its tensor entries, and the chunks of an inline payload.

Consumes: nothing (plain data). Produces: :class:`WeightsManifest`, :class:`TensorEntry` (declared with
:func:`~schemas.declare.struct`), :class:`WeightsChunk`, the :class:`TensorList` field type and
:func:`chunk_count_for`. Every field is declared once, with its wire type, bounds and default; the cross-field
rules are in :mod:`schemas.validation`.

Guarantees: a tensor list is checked entry by entry, each entry's ``nbytes`` against its shape and dtype, and its
errors name the entry (``tensors[2].nbytes``).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, ClassVar

from schemas.declare import COUNT, ID, SHA256, TIME, TOPIC, Message, message, now, spec_of, struct, wire
from schemas.errors import ROOT, SchemaError, wire_type_name
from schemas.fields import Bytes, Enum, FieldType, Float, Int, Optional, Shape, Str
from schemas.spec import check_fields, fields_from_wire, fields_to_wire

WEIGHTS_MODES = ("inline", "store")
"""How a manifest's payload travels: chunks on a per-version topic, or a file in a weights store."""

SAFETENSORS_ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
"""Bytes per element of each safetensors dtype name a manifest may use."""


@struct
class TensorEntry:
    """Where one tensor lies in the flat weights payload (part of a :class:`WeightsManifest`)."""

    name: str = wire(Str(nonempty=True))
    """Parameter name as in the model's state dict, e.g. ``model.layers.0.mlp.up_proj.weight``; unique."""
    dtype: str = wire(Enum(tuple(SAFETENSORS_ITEMSIZE)))
    """safetensors dtype name: ``F32``, ``BF16``, ``F16``, ``I64`` ... (see :data:`SAFETENSORS_ITEMSIZE`)."""
    shape: tuple[int, ...] = wire(Shape())
    """Tensor shape; a list is accepted and stored as a tuple."""
    offset: int = wire(Int(0))
    """Byte offset of the tensor's first byte in the payload."""
    nbytes: int = wire(Int(0))
    """Byte length: ``prod(shape) * itemsize(dtype)``; raw little-endian, C order."""

    def __post_init__(self) -> None:
        if isinstance(self.shape, list):
            object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def end(self) -> int:
        """Offset one past the tensor's last byte."""
        return self.offset + self.nbytes


def chunk_count_for(total_bytes: int, chunk_size: int) -> int:
    """``ceil(total_bytes / chunk_size)``: chunks needed to carry a payload."""
    return -(-total_bytes // chunk_size)


TENSOR_SPEC = spec_of(TensorEntry)
"""The fields of a tensor entry, derived from :class:`TensorEntry`'s declaration."""


class TensorList(FieldType):
    """A non-empty array of tensor entries; errors name the entry (``tensors[2].nbytes``)."""

    def check(self, value: Any) -> None:
        if not isinstance(value, list) or not value:
            raise SchemaError(ROOT, f"expected a non-empty array of tensor entries, got {value!r:.80}")
        for index, entry in enumerate(value):
            try:
                if not isinstance(entry, TensorEntry):
                    raise SchemaError(ROOT, f"expected TensorEntry, got {type(entry).__name__}")
                check_fields(entry, TENSOR_SPEC)
                expected = math.prod(entry.shape) * SAFETENSORS_ITEMSIZE[entry.dtype]
                if entry.nbytes != expected:
                    raise SchemaError("nbytes", f"must be prod(shape) * itemsize = {expected}, got {entry.nbytes}")
            except SchemaError as exc:
                raise exc.nested(f"[{index}]") from None

    def to_wire(self, value: Any) -> list[dict[str, Any]]:
        return [fields_to_wire(entry, TENSOR_SPEC) for entry in value]

    def from_wire(self, raw: Any) -> Any:
        if not isinstance(raw, list):
            return raw
        entries = []
        for index, item in enumerate(raw):
            if not isinstance(item, dict):
                raise SchemaError(f"[{index}]", f"expected map, got {wire_type_name(item)}")
            try:
                entries.append(TensorEntry(**fields_from_wire(item, TENSOR_SPEC)))
            except SchemaError as exc:
                raise exc.nested(f"[{index}]") from None
        return entries


@message
class WeightsManifest(Message):
    """Announces policy version ``version``: what the payload holds and where to fetch it.

    Weights topic, key ``str(version)``. Payload = the tensors' raw bytes concatenated in ``tensors`` order.
    Inline mode: the payload comes as ``chunk_count`` :class:`WeightsChunk` records on ``chunks_topic``, chunk ``i``
    holding ``payload[i * chunk_size : (i + 1) * chunk_size]``. Store mode: a safetensors file at ``store_uri``.
    A delta version (``delta_base`` set) sends its compressed delta the same way instead (chunks, or a raw file at
    ``store_uri``); the receiver rebuilds the payload and checks it against ``sha256`` before use.
    """

    KIND: ClassVar[str] = "weights_manifest"

    version: int = wire(COUNT)
    """Policy version published (>= 0); rollouts carry it in ``token_policy_versions``."""
    step: int = wire(COUNT)
    """Trainer optimiser step after which the weights were taken (>= 0)."""
    mode: str = wire(Enum(WEIGHTS_MODES))
    """``"inline"`` (chunks on a per-version topic) or ``"store"`` (file in a weights store)."""
    tensors: list[TensorEntry] = wire(TensorList())
    """At least one entry, sorted by offset, contiguous from 0, no overlaps, unique names."""
    total_bytes: int = wire(COUNT)
    """Payload size, equal to the sum of the entries' ``nbytes``."""
    sha256: str = wire(SHA256)
    """SHA-256 of the whole payload, 64 lowercase hex characters."""
    chunk_size: int = wire(Int(1))
    """Bytes per chunk (>= 1); the last chunk may be shorter."""
    chunk_count: int = wire(COUNT)
    """``ceil(total_bytes / chunk_size)``, in both modes."""
    chunks_topic: str | None = wire(Optional(TOPIC), default=None)
    """Inline mode: the Kafka topic holding the chunks; must be ``None`` in store mode."""
    store_uri: str | None = wire(Optional(Str(nonempty=True)), default=None)
    """Store mode: where the safetensors file is (path or URI); must be ``None`` in inline mode."""
    created_at: float = wire(TIME, default_factory=now)
    """Unix time the manifest was written, after the payload was durable."""
    trainer_id: str = wire(ID)
    """Id of the trainer that published the version (``ID_PATTERN``)."""
    delta_base: int | None = wire(Optional(COUNT), default=None, added=True)
    """``None``: a full snapshot (what is sent is the payload). Otherwise a delta: what is sent (chunks or the
    store file) is ``zlib(payload XOR payload of version delta_base)``, and ``delta_base < version``."""
    delta_base_sha256: str | None = wire(Optional(SHA256), default=None, added=True)
    """Delta: the ``sha256`` of version ``delta_base``'s payload (which base the delta applies to)."""
    delta_bytes: int | None = wire(Optional(Int(1)), default=None, added=True)
    """Delta: size of the compressed delta that is sent; ``chunk_count`` counts its chunks."""
    delta_sha256: str | None = wire(Optional(SHA256), default=None, added=True)
    """Delta: SHA-256 of the compressed delta. ``sha256`` stays the digest of the rebuilt payload."""
    adapter_rank: int | None = wire(Optional(Int(1)), default=None, added=True)
    """``None``: the tensors are the policy's weights. Otherwise a LoRA adapter version (``trainer.lora``): the
    tensors are ``{module}.lora_A.weight`` ``[r, in]`` and ``{module}.lora_B.weight`` ``[out, r]`` of a frozen base
    (the producers' own model directory), applied as ``W = W0 + (adapter_alpha / adapter_rank) * B A``."""
    adapter_alpha: float | None = wire(Optional(Float(greater_than=0.0)), default=None, added=True)
    """LoRA alpha (> 0); set exactly when ``adapter_rank`` is."""

    @property
    def is_delta(self) -> bool:
        return self.delta_base is not None

    @property
    def is_adapter(self) -> bool:
        return self.adapter_rank is not None

    @property
    def sent_bytes(self) -> int:
        """Bytes that travel for this version: the delta's size for a delta, else the payload's."""
        return self.delta_bytes if self.delta_bytes is not None else self.total_bytes

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of chunk ``index`` in what is sent (the payload, or the delta)."""
        if not 0 <= index < self.chunk_count:
            raise IndexError(f"chunk {index} out of range 0..{self.chunk_count - 1}")
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.sent_bytes)


@message
class WeightsChunk(Message):
    """One slice of an inline weights payload. Topic ``manifest.chunks_topic``, key ``str(version)``."""

    KIND: ClassVar[str] = "weights_chunk"

    version: int = wire(COUNT)
    """Policy version the chunk belongs to (>= 0)."""
    index: int = wire(COUNT)
    """Chunk position, ``0 <= index < count``."""
    count: int = wire(Int(1))
    """Number of chunks of the version (>= 1), equal to the manifest's ``chunk_count``."""
    data: bytes = wire(Bytes(nonempty=True))
    """The chunk's bytes (non-empty)."""
    sha256: str = wire(SHA256)
    """SHA-256 of ``data``, 64 lowercase hex characters; checked on decode."""

    @classmethod
    def from_data(cls, *, version: int, index: int, count: int, data: bytes) -> WeightsChunk:
        """A chunk with its digest computed. The chunk remembers that its digest was computed from its own
        (immutable) bytes, so validating it before sending does not hash them again; a chunk built any other way,
        decoded ones included, is hashed when validated."""
        chunk = cls(version=version, index=index, count=count, data=data, sha256=hashlib.sha256(data).hexdigest())
        if type(data) is bytes:  # immutable: the digest cannot go stale (the dataclass is frozen too)
            object.__setattr__(chunk, "_digest_of_data", True)
        return chunk
