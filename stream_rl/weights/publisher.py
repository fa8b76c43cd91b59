"""The trainer side of the weight broadcast: publish a version, garbage-collect old ones.

Consumes: a state dict (CPU copies that do not alias the live model, e.g. from
``stream_rl.models.loading.state_dict_for_broadcast``), the trainer's :class:`Transport` and :class:`Sink`.
Produces: per version either chunk records on ``names.weights_chunks(version)`` (inline) or a safetensors file
``{store_dir}/v{version:08d}.safetensors`` (store), then one :class:`WeightsManifest` on ``names.weights``,
key ``str(version)``. With ``weights.snapshot_every`` K > 1, versions between full snapshots are deltas against
the version published before them (:mod:`stream_rl.weights.delta`): chunks on ``weights.v{N}.delta`` or a file
``v{N:08d}.delta``, the mode chosen by the delta's size. A LoRA version (``publish(adapter=(rank, alpha))``) is
published the same way, its manifest stamped with ``adapter_rank`` / ``adapter_alpha`` (docs/weights.md).
Guarantees (the order is the contract; see docs/weights.md)::

    inline: create chunk topic (1 partition) ─> send chunks ─> sink.flush() (acked) ─> send manifest ─> flush
    store:  save_file to a tmp file (streamed, hashed once through a memory map) ─> validate the manifest
            ─> fsync file ─> rename to v{N:08d}.safetensors ─> fsync dir ─> send manifest ─> flush

- Deltas: the first version a publisher sends, every K-th after a snapshot, ``publish(snapshot=True)``, a change
  of tensor names, dtypes or shapes, and a delta that would not be smaller than half the payload all go out as
  full snapshots. A delta is always against the newest version whose manifest was acknowledged.

- A manifest on the weights topic therefore implies its payload is complete and durable: a receiver that sees
  the manifest never waits for chunks that are still in flight, and a late joiner can start from the newest one.
- The manifest is validated before anything is sent or renamed into place (store mode: the temporary file is
  removed when it is invalid), so an invalid version leaves no orphan payload.
- ``publish`` returns only after the broker acknowledged the manifest (``DeliveryError`` otherwise).
- ``collect_garbage`` removes the chunk topics and store files of every version but the newest ``keep_last``
  found on the broker and in the store (including those of earlier trainer processes), and tolerates versions
  already gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from schemas import TensorEntry, WeightsManifest, chunk_count_for, validate
from stream_rl.runtime import failpoints
from stream_rl.storage.fsync import fsync_path
from stream_rl.weights.config import WeightsConfig
from stream_rl.weights.delta import doomed_versions, encode_delta, flat_payload, same_layout
from stream_rl.weights.payload import (
    Payload,
    StoredPayload,
    build_manifest,
    make_chunks,
    payload_size,
    prepare,
    save_store_file,
    serialize,
    sha256_hex,
)

if TYPE_CHECKING:
    import torch

    from stream_rl.transport.admin import Admin

log = logging.getLogger(__name__)

CHUNK_ENVELOPE_BYTES = 16 * 1024
"""Room left in a record for the chunk's msgpack envelope, key, trace headers and Kafka record overhead."""
FLUSH_EVERY_BYTES = 16 << 20
"""Inline sends wait for acks after this many bytes, so the producer's buffer never has to hold a whole model."""
STORE_FILE = re.compile(r"^v(\d{8})\.safetensors$")
"""A complete store-mode version file (group 1: the version); written by rename, so never partial."""
STORE_TMP = re.compile(r"^\.v(\d{8})\.(?:safetensors|delta)\.[0-9a-f]+\.tmp$")
"""A store-mode file being written (group 1: the version)."""
DELTA_FILE = re.compile(r"^v(\d{8})\.delta$")
"""A complete store-mode delta version: the compressed delta, raw (group 1: the version)."""
MAX_DELTA_RATIO = 0.5
"""A delta larger than this fraction of the payload is not worth a rebuild: the version goes out full."""


@dataclasses.dataclass(frozen=True)
class _Base:
    """The newest acknowledged version, which the next delta is taken against."""

    version: int
    sha256: str
    index: tuple[TensorEntry, ...]
    flat: np.ndarray  # uint8 [total_bytes]: the payload


@dataclasses.dataclass(frozen=True)
class _Delta:
    flat: np.ndarray  # uint8 [total_bytes]: the new payload
    sha256: str  # of ``flat``
    blob: bytes  # the compressed delta against the base


_T = TypeVar("_T")


def _write_durably(path: Path, write: Callable[[Path], _T]) -> _T:
    """``write`` a temporary file beside ``path`` (it validates what it wrote, raising when invalid), then fsync it,
    rename it to ``path`` and fsync the directory; any failure removes the temporary file (no orphan payload)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        result = write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return result


def choose_mode(cfg: WeightsConfig, total_bytes: int) -> str:
    """``inline`` or ``store`` for a payload of ``total_bytes`` under ``cfg.mode``."""
    if cfg.mode == "auto":
        return "store" if total_bytes > cfg.inline_max_bytes else "inline"
    return cfg.mode


def store_file_name(version: int, delta: bool = False) -> str:
    return f"v{version:08d}.delta" if delta else f"v{version:08d}.safetensors"


class WeightsPublisher:
    """Publishes policy versions for one trainer (not thread-safe: one publish at a time)."""

    def __init__(self, transport, sink, weights_cfg: WeightsConfig, trainer_id: str):
        self._transport = transport
        self._sink = sink
        self.cfg = weights_cfg
        self.trainer_id = trainer_id
        self._topics_ready = False  # the run's topics (the weights topic among them) exist
        self._base: _Base | None = None  # what the next delta is against (snapshot_every > 1 only)
        self._since_snapshot = 0  # deltas published since the last full snapshot
        run_dir = Path(transport.cfg.run_dir)
        self.store_dir = Path(weights_cfg.store_dir) if weights_cfg.store_dir is not None else run_dir / "weights"
        limit = transport.cfg.kafka.max_request_size
        if weights_cfg.mode != "store" and weights_cfg.chunk_size + CHUNK_ENVELOPE_BYTES > limit:
            raise ValueError(f"weights.chunk_size {weights_cfg.chunk_size} + {CHUNK_ENVELOPE_BYTES} bytes of "
                             f"envelope exceeds kafka.max_request_size {limit}")

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int, step: int,
                snapshot: bool = False, adapter: tuple[int, float] | None = None) -> WeightsManifest:
        """Make ``state_dict`` available as ``version`` (after optimizer step ``step``); return its manifest.
        ``snapshot``: send it full even where a delta would do. ``adapter``: ``(rank, alpha)`` when
        ``state_dict`` holds LoRA adapter tensors (``trainer.lora``), stamped on the manifest."""
        started = time.monotonic()
        tensors = prepare(state_dict)
        delta = None if snapshot else self._delta_of(tensors)
        if delta is None:
            manifest, flat = self._send_full(tensors, version, step)
        else:
            manifest, flat = self._send_delta(delta, version, step), delta.flat
        failpoints.hit("weights.mid_publish")  # recovery drills: the payload exists, its manifest does not
        manifest = dataclasses.replace(manifest, created_at=time.time())  # the payload is durable now
        if adapter is not None:
            manifest = dataclasses.replace(manifest, adapter_rank=adapter[0], adapter_alpha=float(adapter[1]))
        self._sink.send(self._transport.names.weights, manifest, key=str(version))
        self._sink.flush()
        self._remember(manifest, tensors, flat)
        log.info("published weights v%d (step %d, %s%s, %d of %d bytes, %d tensors) in %.3fs", version, step,
                 manifest.mode, f", delta against v{manifest.delta_base}" if manifest.is_delta else "",
                 manifest.sent_bytes, manifest.total_bytes, len(manifest.tensors), time.monotonic() - started)
        return manifest

    def _send_full(self, tensors: Mapping[str, torch.Tensor], version: int,
                   step: int) -> tuple[WeightsManifest, np.ndarray | None]:
        """Send the whole payload (chunks or a store file); return the manifest to announce it, and the payload
        bytes when they are at hand already (inline)."""
        mode = choose_mode(self.cfg, payload_size(tensors))
        if mode == "inline":
            payload = serialize(tensors)
            topic = self._transport.names.weights_chunks(version)
            manifest = validate(self._manifest(payload, version, step, mode, chunks_topic=topic))
            self._send_chunks(payload.data, manifest)
            return manifest, np.frombuffer(payload.data, dtype=np.uint8)
        self._ensure_topics()
        path = (self.store_dir / store_file_name(version)).resolve()
        _, manifest = self._write_file(tensors, path, version, step)
        return manifest, None

    def _delta_of(self, tensors: Mapping[str, torch.Tensor]) -> _Delta | None:
        """The delta of ``tensors`` against the base, or None where a full snapshot is due or cheaper."""
        base = self._base
        if base is None or self._since_snapshot + 1 >= self.cfg.snapshot_every:
            return None
        if not same_layout(tensors, base.index):
            log.info("weights: tensor names, dtypes or shapes changed since v%d; sending a full snapshot",
                     base.version)
            return None
        flat = flat_payload(tensors, base.index)
        blob = encode_delta(flat, base.flat)
        if blob is None or len(blob) > MAX_DELTA_RATIO * flat.size:
            log.info("weights: a delta against v%d would be %s; sending a full snapshot", base.version,
                     "most of the payload" if blob is None else f"{len(blob)} of {flat.size} bytes")
            return None
        return _Delta(flat, sha256_hex(memoryview(flat)), blob)

    def _send_delta(self, delta: _Delta, version: int, step: int) -> WeightsManifest:
        base = self._base
        assert base is not None
        mode = choose_mode(self.cfg, len(delta.blob))
        manifest = WeightsManifest(
            version=version, step=step, mode=mode, tensors=list(base.index), total_bytes=delta.flat.size,
            sha256=delta.sha256, chunk_size=self.cfg.chunk_size,
            chunk_count=chunk_count_for(len(delta.blob), self.cfg.chunk_size), trainer_id=self.trainer_id,
            delta_base=base.version, delta_base_sha256=base.sha256, delta_bytes=len(delta.blob),
            delta_sha256=sha256_hex(delta.blob))
        if mode == "inline":
            topic = self._transport.names.weights_chunks(version, delta=True)
            manifest = validate(dataclasses.replace(manifest, chunks_topic=topic))
            self._send_chunks(memoryview(delta.blob), manifest)
            return manifest
        self._ensure_topics()
        path = (self.store_dir / store_file_name(version, delta=True)).resolve()
        manifest = dataclasses.replace(manifest, store_uri=path.as_uri())
        self._write_blob(delta.blob, path, manifest)
        return manifest

    def _remember(self, manifest: WeightsManifest, tensors: Mapping[str, torch.Tensor],
                  flat: np.ndarray | None) -> None:
        """After an acknowledged manifest: it is the base of the next delta (when deltas are on)."""
        if self.cfg.snapshot_every == 1:
            return
        self._since_snapshot = self._since_snapshot + 1 if manifest.is_delta else 0
        index = tuple(manifest.tensors)
        self._base = _Base(manifest.version, manifest.sha256, index,
                           flat if flat is not None else flat_payload(tensors, index))

    def _ensure_topics(self) -> None:
        if not self._topics_ready:
            self._transport.ensure_topics()
            self._topics_ready = True

    def _manifest(self, payload: Payload | StoredPayload, version: int, step: int, mode: str,
                  **where: str) -> WeightsManifest:
        return build_manifest(payload, version=version, step=step, mode=mode, chunk_size=self.cfg.chunk_size,
                              trainer_id=self.trainer_id, **where)

    def _send_chunks(self, data: memoryview, manifest: WeightsManifest) -> None:
        topic = manifest.chunks_topic
        self._transport.ensure_topics(extra={topic: 1})  # the run's topics (weights included) and this one
        self._topics_ready = True
        unflushed = 0
        for chunk in make_chunks(data, manifest.version, manifest.chunk_size):
            self._sink.send(topic, chunk, key=str(manifest.version), partition=0)
            unflushed += len(chunk.data)
            if unflushed >= FLUSH_EVERY_BYTES:
                self._sink.flush()
                unflushed = 0
        self._sink.flush()  # every chunk acknowledged before the manifest exists

    def _write_file(self, tensors: Mapping[str, torch.Tensor], path: Path, version: int,
                    step: int) -> tuple[StoredPayload, WeightsManifest]:
        """Write the version file under a temporary name, validate its manifest, fsync, rename, fsync the
        directory; an invalid manifest or any failure removes the temporary file (no orphan payload)."""
        def write(tmp: Path) -> tuple[StoredPayload, WeightsManifest]:
            payload = save_store_file(tensors, tmp)
            return payload, validate(self._manifest(payload, version, step, "store", store_uri=path.as_uri()))

        return _write_durably(path, write)

    def _write_blob(self, blob: bytes, path: Path, manifest: WeightsManifest) -> None:
        """A delta's store file, written as :meth:`_write_file` writes a snapshot."""
        def write(tmp: Path) -> None:
            tmp.write_bytes(blob)
            validate(manifest)

        _write_durably(path, write)

    def collect_garbage(self, keep_last: int | None = None) -> list[int]:
        """Delete chunk topics and store files of all versions but the newest ``keep_last`` (default
        ``cfg.keep_last``); return the versions removed, oldest first."""
        keep = self.cfg.keep_last if keep_last is None else keep_last
        if keep < 1:
            raise ValueError(f"keep_last must be >= 1 (the newest version is in use), got {keep}")
        # every version below the newest snapshot at or below the oldest kept one (delta.doomed_versions)
        with self._transport.admin() as admin:
            topics, delta_topics = self._chunk_topics(admin.list_topics())
            files, delta_files = self._store_files(STORE_FILE), self._store_files(DELTA_FILE)
            doomed = doomed_versions(set(topics) | set(files), set(delta_topics) | set(delta_files), keep)
            self._delete_topics(admin, [t[v] for t in (topics, delta_topics) for v in doomed if v in t])
        for version in doomed:
            for found in (files, delta_files):
                if version in found:
                    found[version].unlink(missing_ok=True)
        self._remove_abandoned_tmp(max([*topics, *delta_topics, *files, *delta_files], default=-1))
        if doomed:
            log.info("weights garbage collection removed versions %s", doomed)
        return doomed

    def _chunk_topics(self, topic_names: Iterable[str]) -> tuple[dict[int, str], dict[int, str]]:
        """The chunk topics on the broker by version: (full payloads, deltas)."""
        head = self._transport.names.weights + ".v"
        full, deltas = {}, {}
        for name in topic_names:
            if not name.startswith(head):
                continue
            tail = name[len(head):]
            if tail.isdigit():
                full[int(tail)] = name
            elif tail.endswith(".delta") and tail[:-len(".delta")].isdigit():
                deltas[int(tail[:-len(".delta")])] = name
        return full, deltas

    def _store_files(self, pattern: re.Pattern[str]) -> dict[int, Path]:
        if not self.store_dir.is_dir():
            return {}
        found = {}
        for path in self.store_dir.iterdir():
            match = pattern.match(path.name)
            if match:
                found[int(match.group(1))] = path
        return found

    @staticmethod
    def _delete_topics(admin: Admin, names: list[str]) -> None:
        """Delete chunk topics; one already gone is tolerated."""
        from stream_rl.transport.admin import TopicDeletionError

        try:
            admin.delete_topics(names, missing_ok=True)
        except TopicDeletionError as exc:
            raise RuntimeError(f"deleting weights topic {exc.topic} failed: error {exc.code} "
                               f"{exc.error_message}") from exc

    def _remove_abandoned_tmp(self, newest: int) -> None:
        """Temporary files of versions up to the newest one are left over from crashed writes."""
        if not self.store_dir.is_dir():
            return
        for path in self.store_dir.iterdir():
            match = STORE_TMP.match(path.name)
            if match and int(match.group(1)) <= newest:
                path.unlink(missing_ok=True)
