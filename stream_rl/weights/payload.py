"""Weights payloads: state dict <-> safetensors bytes, tensor index, chunks, digests and checks. Pure: no Kafka.

Consumes: a state dict (``dict[str, torch.Tensor]``) on the publishing side; a :class:`WeightsManifest` with its
chunks or its safetensors file on the receiving side.
Produces: a :class:`Payload` (a complete safetensors file in memory, its tensor index and digest), the manifest
and :class:`WeightsChunk` records that describe and carry it, and decoded, verified state dicts.

Layout (also in docs/weights.md and docs/wire-format.md)::

    safetensors file  = [u64 LE header length N][N bytes JSON header][data section .......................]
                                                                      ^ payload offset 0
    payload           = the data section alone: every tensor's raw bytes (little-endian, C order) back to back,
                        in the order safetensors laid them out (by dtype alignment, then name)
    TensorEntry       = (name, dtype, shape, offset, nbytes) where offset is the header's ``data_offsets[0]``,
                        i.e. an offset into the PAYLOAD (data section), not into the file
    manifest.sha256   = SHA-256 of the payload; total_bytes = len(payload) = sum of nbytes
    inline chunk i    = payload[i * chunk_size : (i + 1) * chunk_size], with its own SHA-256
    store file        = the whole safetensors file, header included

An inline receiver copies the chunks into one preallocated buffer, checks its digest and returns tensors that are
views of it, laid out by the manifest's index (validated on decode: sorted, contiguous, ``nbytes`` = shape x
itemsize). The store side writes the file with ``safetensors.torch.save_file`` (streamed, no whole-file copy in
memory) and hashes it once through a memory map; a store receiver maps the file (private, copy-on-write), parses
its own header, requires it to equal the manifest's index, hashes the mapped data section once and returns
tensors that are views of that mapping (no copy: what was hashed is what is used).

Guarantees: every receiving-side check raises :class:`WeightsError` (``"weights v{N}: <problem>"``) before any
tensor is returned, so a caller gets all verified tensors or an exception, never part of a version. Digests are
checked before any tensor is made, and a store file's own header must equal the manifest's index.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas import SAFETENSORS_ITEMSIZE, TensorEntry, WeightsChunk, WeightsManifest, chunk_count_for

if TYPE_CHECKING:
    import torch

_U64 = struct.Struct("<Q")
_SHOW = 8  # how many items an error message lists


class WeightsError(RuntimeError):
    """A weights version cannot be used: missing, incomplete, corrupted or inconsistent with its manifest."""

    def __init__(self, version: int, problem: str):
        super().__init__(f"weights v{version}: {problem}")
        self.version = version
        self.problem = problem


@dataclass(frozen=True)
class Payload:
    """A serialized state dict: a complete safetensors file, and inside it the payload (its data section)."""

    file_bytes: bytes
    """The safetensors file: header length, JSON header, data section."""
    data_start: int
    """Offset of the data section (= payload offset 0) in ``file_bytes``."""
    tensors: tuple[TensorEntry, ...]
    """Tensor index, sorted by offset; offsets are relative to the payload."""
    sha256: str
    """SHA-256 of the payload (the data section), lowercase hex."""

    @property
    def data(self) -> memoryview:
        """The payload: the file's data section, without a copy."""
        return memoryview(self.file_bytes)[self.data_start:]

    @property
    def total_bytes(self) -> int:
        return len(self.file_bytes) - self.data_start


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """Lowercase hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def _show(items: list[Any]) -> str:
    head = ", ".join(map(str, items[:_SHOW]))
    return f"{head} (+{len(items) - _SHOW} more)" if len(items) > _SHOW else head


def serialize(state_dict: Mapping[str, torch.Tensor]) -> Payload:
    """The payload of ``state_dict``: tensors are detached, moved to CPU and made contiguous (a copy only where
    needed), then written with ``safetensors.torch.save``. Dtypes are kept as they are (bf16 stays bf16).

    Raises ValueError for an empty dict or a dtype a manifest cannot carry; safetensors raises for tensors that
    share memory (send one name per tied group, as ``stream_rl.models.loading.state_dict_for_broadcast`` does).
    """
    import safetensors.torch

    file_bytes = safetensors.torch.save(prepare(state_dict))
    entries, data_start = parse_header(file_bytes)
    return Payload(file_bytes, data_start, entries, sha256_hex(memoryview(file_bytes)[data_start:]))


def prepare(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict``'s tensors detached, on the CPU and contiguous (a copy only where needed); ValueError when
    it is empty."""
    if not state_dict:
        raise ValueError("cannot serialize an empty state dict")
    return {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}


def payload_size(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the payload (data section) ``tensors`` make: the sum of their sizes."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass(frozen=True)
class StoredPayload:
    """A payload written straight to a safetensors file: its index and digest (what a manifest needs)."""

    tensors: tuple[TensorEntry, ...]
    total_bytes: int
    sha256: str


def save_store_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike) -> StoredPayload:
    """Write ``tensors`` (from :func:`prepare`) as a safetensors file at ``path`` with ``save_file``, which
    streams them to the file (no in-memory copy of the whole file), then read its index back and hash its data
    section once, through a memory map of the page-cached file. Not fsynced (the caller decides)."""
    import safetensors.torch

    safetensors.torch.save_file(dict(tensors), str(path))
    with open(path, "rb") as handle:
        entries, data_start, mapped = map_file(handle)
    with memoryview(mapped) as view:
        digest = sha256_hex(view[data_start:])
    return StoredPayload(entries, len(mapped) - data_start, digest)


def map_file(handle) -> tuple[tuple[TensorEntry, ...], int, mmap.mmap]:
    """The tensor index, data-section start and a private (copy-on-write) memory map of the safetensors file
    open as ``handle``; ValueError as :func:`parse_header` for a malformed file."""
    size = os.fstat(handle.fileno()).st_size
    prefix = handle.read(_U64.size)
    if len(prefix) < _U64.size:
        raise ValueError(f"safetensors file too short ({size} bytes)")
    (header_len,) = _U64.unpack(prefix)
    if _U64.size + header_len > size:
        raise ValueError(f"safetensors header length {header_len} runs past the end ({size} bytes)")
    entries, data_start = _index(prefix + handle.read(header_len), size)
    return entries, data_start, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)


def parse_header(file_bytes: bytes) -> tuple[tuple[TensorEntry, ...], int]:
    """The tensor index (payload-relative offsets, sorted) and data-section start of a safetensors file.

    Raises ValueError when the header is malformed, names a dtype a manifest cannot carry, or its entries do not
    tile the data section exactly.
    """
    if len(file_bytes) < _U64.size:
        raise ValueError(f"safetensors file too short ({len(file_bytes)} bytes)")
    (header_len,) = _U64.unpack_from(file_bytes)
    data_start = _U64.size + header_len
    if data_start > len(file_bytes):
        raise ValueError(f"safetensors header length {header_len} runs past the end ({len(file_bytes)} bytes)")
    return _index(bytes(file_bytes[:data_start]), len(file_bytes))


def _index(head: bytes, file_size: int) -> tuple[tuple[TensorEntry, ...], int]:
    """The index of a file of ``file_size`` bytes from ``head`` (its length prefix and JSON header)."""
    data_start = len(head)
    try:
        header = json.loads(head[_U64.size:])
        entries = sorted((_entry(name, spec) for name, spec in header.items() if name != "__metadata__"),
                         key=lambda e: e.offset)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"malformed safetensors header: {exc!r}") from None
    _check_tiling(entries, file_size - data_start)
    return tuple(entries), data_start


def _entry(name: str, spec: dict[str, Any]) -> TensorEntry:
    dtype, shape, (start, end) = spec["dtype"], spec["shape"], spec["data_offsets"]
    if dtype not in SAFETENSORS_ITEMSIZE:
        raise ValueError(f"tensor {name!r} has dtype {dtype}, which a manifest cannot carry")
    if not all(isinstance(d, int) and d >= 0 for d in shape) or not isinstance(start, int) or end < start:
        raise ValueError(f"tensor {name!r}: bad shape {shape} or data_offsets [{start}, {end}]")
    nbytes = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
    if end - start != nbytes:
        raise ValueError(f"tensor {name!r}: data_offsets span {end - start} bytes, shape x dtype needs {nbytes}")
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), offset=start, nbytes=nbytes)


def _check_tiling(entries: list[TensorEntry], data_len: int) -> None:
    end = 0
    for entry in entries:
        if entry.offset != end:
            raise ValueError(f"tensor {entry.name!r} starts at {entry.offset}, expected {end} (gap or overlap)")
        end = entry.end
    if end != data_len:
        raise ValueError(f"tensors cover {end} bytes but the data section has {data_len}")


def build_manifest(payload: Payload | StoredPayload, *, version: int, step: int, mode: str, chunk_size: int, trainer_id: str,
                   chunks_topic: str | None = None, store_uri: str | None = None) -> WeightsManifest:
    """The manifest announcing ``payload`` as ``version`` (not validated here; ``schemas.validate`` does that)."""
    return WeightsManifest(
        version=version, step=step, mode=mode, tensors=list(payload.tensors), total_bytes=payload.total_bytes,
        sha256=payload.sha256, chunk_size=chunk_size, chunk_count=chunk_count_for(payload.total_bytes, chunk_size),
        chunks_topic=chunks_topic, store_uri=store_uri, trainer_id=trainer_id)


def split(data: bytes | memoryview, chunk_size: int) -> Iterator[bytes]:
    """``data`` in pieces of ``chunk_size`` bytes (the last may be shorter); nothing for empty ``data``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    view = memoryview(data)
    for start in range(0, len(view), chunk_size):
        yield bytes(view[start:start + chunk_size])


def make_chunks(data: bytes | memoryview, version: int, chunk_size: int) -> Iterator[WeightsChunk]:
    """The inline chunk records of ``data`` (a payload, or a delta), each with its own digest."""
    count = chunk_count_for(len(data), chunk_size)
    for index, piece in enumerate(split(data, chunk_size)):
        yield WeightsChunk.from_data(version=version, index=index, count=count, data=piece)


def check_chunk(manifest: WeightsManifest, chunk: WeightsChunk, digest_checked: bool = False) -> None:
    """Raise WeightsError unless ``chunk`` is a well-formed, intact piece of ``manifest``'s payload.
    ``digest_checked``: the chunk came from ``schemas.decode``, whose validation already matched its SHA-256
    against its bytes, so it is not hashed again."""
    version, index = manifest.version, chunk.index
    if chunk.version != version:
        raise WeightsError(version, f"chunk {index} on the version's topic belongs to version {chunk.version}")
    if chunk.count != manifest.chunk_count:
        raise WeightsError(version, f"chunk {index} says count {chunk.count}, manifest says {manifest.chunk_count}")
    if not 0 <= index < manifest.chunk_count:
        raise WeightsError(version, f"chunk index {index} outside 0..{manifest.chunk_count - 1}")
    start, end = manifest.chunk_range(index)
    if len(chunk.data) != end - start:
        raise WeightsError(version, f"chunk {index} has {len(chunk.data)} bytes, expected {end - start}")
    if digest_checked:
        return
    digest = sha256_hex(chunk.data)
    if digest != chunk.sha256:
        raise WeightsError(version, f"chunk {index} sha256 mismatch: record says {chunk.sha256}, data hashes to "
                                    f"{digest}")


def gather(manifest: WeightsManifest, chunks: Iterable[WeightsChunk], digests_checked: bool = False) -> np.ndarray:
    """What ``manifest``'s chunks carry (the payload, or a delta: ``sent_bytes``), copied once into one
    preallocated ``uint8`` buffer, after checking every chunk and the index coverage.

    When an index occurs more than once (a version re-published after a crash), the last copy read wins; the
    digest of the whole then decides whether the result is the manifest's version.
    """
    buffer = np.empty(manifest.sent_bytes, dtype=np.uint8)
    seen: set[int] = set()
    for chunk in chunks:
        check_chunk(manifest, chunk, digests_checked)
        start, end = manifest.chunk_range(chunk.index)
        buffer[start:end] = np.frombuffer(chunk.data, dtype=np.uint8)
        seen.add(chunk.index)
    missing = [i for i in range(manifest.chunk_count) if i not in seen]
    if missing:
        raise WeightsError(manifest.version, f"missing {len(missing)} of {manifest.chunk_count} chunks: "
                                             f"{_show(missing)}")
    return buffer


def assemble(manifest: WeightsManifest, chunks: Iterable[WeightsChunk], digests_checked: bool = False) -> np.ndarray:
    """The payload of a full version from its ``chunks`` (:func:`gather`), its size and SHA-256 checked."""
    if manifest.is_delta:
        raise WeightsError(manifest.version, f"is a delta against v{manifest.delta_base}, not a full payload")
    data = gather(manifest, chunks, digests_checked)
    check_payload(manifest, data)
    return data


def check_delta(manifest: WeightsManifest, blob: bytes | memoryview | np.ndarray) -> None:
    """Raise WeightsError unless ``blob`` has the delta's size and SHA-256 (``delta_bytes``, ``delta_sha256``)."""
    _check_bytes(manifest.version, "delta", blob, manifest.delta_bytes, manifest.delta_sha256)


def check_payload(manifest: WeightsManifest, data: bytes | memoryview | np.ndarray) -> None:
    """Raise WeightsError unless ``data`` has the manifest's size and SHA-256."""
    _check_bytes(manifest.version, "payload", data, manifest.total_bytes, manifest.sha256)


def _check_bytes(version: int, what: str, data: bytes | memoryview | np.ndarray, size: int | None,
                 sha256: str | None) -> None:
    if len(data) != size:
        raise WeightsError(version, f"{what} has {len(data)} bytes, manifest says {size}")
    digest = sha256_hex(memoryview(data))
    if digest != sha256:
        raise WeightsError(version, f"{what} sha256 {digest} does not match the manifest's {sha256}")


def tensors_from_chunks(manifest: WeightsManifest, chunks: Iterable[WeightsChunk],
                        digests_checked: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of an inline full version: the chunks checked and copied into one buffer (which verifies the
    payload's size and SHA-256), the tensors views of that buffer laid out by the manifest's index. The payload is
    hashed once, and each chunk once (``digests_checked``: by ``schemas.decode`` already, see :func:`check_chunk`)."""
    return tensor_views(manifest.tensors, assemble(manifest, chunks, digests_checked))


def payload_from_store(manifest: WeightsManifest, path: str | os.PathLike) -> np.ndarray:
    """The verified payload of a store-mode full version: ``uint8 [total_bytes]``, a view of a private
    (copy-on-write) memory map of its file, whose header must equal the manifest index and whose data section
    must have its size and SHA-256 (one pass over the mapped bytes)."""
    version = manifest.version
    try:
        with open(path, "rb") as handle:
            entries, data_start, mapped = map_file(handle)
    except FileNotFoundError:
        raise WeightsError(version, f"store file {path} not found (garbage-collected?)") from None
    except ValueError as exc:
        raise WeightsError(version, f"store file: {exc}") from None
    except OSError as exc:
        raise WeightsError(version, f"cannot read store file {path}: {exc}") from None
    _compare_index(manifest, entries)
    data = np.frombuffer(mapped, dtype=np.uint8, offset=data_start)
    check_payload(manifest, data)
    return data


def tensors_from_store(manifest: WeightsManifest, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a store-mode full version: views of :func:`payload_from_store` (no copy, and what was
    hashed is what is returned; a write to a tensor stays in this process's memory)."""
    return tensor_views(manifest.tensors, payload_from_store(manifest, path))


def tensor_views(entries: Iterable[TensorEntry], payload: np.ndarray) -> dict[str, torch.Tensor]:
    """Tensors laid out by ``entries`` over a writable ``uint8`` payload, as views of it (no copy)."""
    import torch

    dtypes = {name: dtype for dtype, name in torch_dtype_names().items()}
    out = {}
    for e in entries:
        dtype = dtypes[e.dtype]
        if e.nbytes == 0:
            out[e.name] = torch.empty(e.shape, dtype=dtype)
            continue
        count = e.nbytes // SAFETENSORS_ITEMSIZE[e.dtype]
        out[e.name] = torch.frombuffer(payload, dtype=dtype, count=count, offset=e.offset).reshape(e.shape)
    return out


def _compare_index(manifest: WeightsManifest, entries: tuple[TensorEntry, ...]) -> None:
    if len(entries) != len(manifest.tensors):
        raise WeightsError(manifest.version, f"file has {len(entries)} tensors, manifest lists "
                                             f"{len(manifest.tensors)}")
    for got, want in zip(entries, manifest.tensors):
        if got != want:
            raise WeightsError(manifest.version, f"file index entry {got} differs from manifest entry {want}")


def torch_dtype_names() -> dict[Any, str]:
    """torch dtype -> safetensors dtype name, for every dtype a manifest may carry."""
    import torch

    by_name = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
               "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    return {dtype: name for name, dtype in by_name.items()}
