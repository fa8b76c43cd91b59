"""The producer side of the weight broadcast: learn of new versions, fetch and verify one.

Consumes: the run's weights topic (manifests, read group-less from offset 0, never from ``latest``), the chunk
topic of the version being fetched (group-less, offset 0 up to the high-water mark taken from a fetch response),
or the version's safetensors file in the weights store.
Produces: the newest :class:`WeightsManifest` seen so far (``poll_latest``), the newest few manifests newer than a
given version, newest first (``candidates``: the fallbacks when the newest fails verification), and a verified
state dict (``fetch``).
Guarantees:
- A manifest is published only after its whole payload is acknowledged or durable, so the newest manifest seen is
  the newest complete version: a late joiner starts there without waiting for anything in flight.
- ``fetch`` returns every tensor of the version, verified (each chunk's SHA-256, count, length and index coverage;
  the whole payload's size and SHA-256; a store file's header against the manifest's index), or raises
  :class:`WeightsError` ``"weights v{N}: <problem>"``. It never returns part of a version, and it gives up after
  ``weights.fetch_timeout_s`` instead of waiting forever for a missing or stalled chunk.
- A delta version (``delta_base`` set) is rebuilt from the payload this receiver holds (the last one it verified,
  kept while deltas are in use) when that is the delta's base, else from the newest snapshot before it plus every
  delta after it; every link's rebuilt payload must hash to its own manifest's ``sha256``, or the fetch raises
  and nothing held changes. A rebuild from the held payload that fails is retried once from the snapshot; when
  that fails too, the first failure is raised.
- ``candidates`` remembers the last manifest of each of the newest ``2 * weights.keep_last +
  weights.snapshot_every`` versions seen (enough for every delta chain that garbage collection keeps), so the
  state it keeps is bounded.
- Invalid records on the weights topic are skipped with a warning and counted (``invalid_manifests``); this
  reader does not own the topic and has no dead-letter sink.
- Readers are created per fetch and closed after it, so no client keeps a garbage-collected chunk topic in its
  metadata (a consumer refreshing metadata for a deleted topic can re-create it on brokers that auto-create).
"""

from __future__ import annotations

import logging
import os
import time
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas import SchemaError, WeightsChunk, WeightsManifest, decode
from stream_rl.weights.config import WeightsConfig
from stream_rl.weights.delta import apply_delta
from stream_rl.weights.payload import (
    WeightsError, assemble, check_delta, check_payload, gather, payload_from_store, tensor_views,
)

if TYPE_CHECKING:
    import torch

__all__ = ["WeightsError", "WeightsReceiver", "path_from_uri"]

log = logging.getLogger(__name__)

TOPIC_WAIT_S = 5.0
"""How long a fetch waits for the chunk topic to appear in metadata (it exists before its manifest does)."""
_POLL_S = 0.2


@dataclass(frozen=True)
class _Held:
    """The payload of the last version this receiver verified: the base a following delta applies to."""

    version: int
    sha256: str
    flat: np.ndarray  # uint8 [total_bytes], never written after it was verified


class WeightsReceiver:
    """Follows the weights topic for one producer process; fetches versions on request."""

    def __init__(self, transport, weights_cfg: WeightsConfig):
        self._transport = transport
        self.cfg = weights_cfg
        self._topic = transport.names.weights
        self._reader = transport.reader()
        self._parts: list[tuple[str, int]] = []
        self._latest: WeightsManifest | None = None
        self._recent: dict[int, WeightsManifest] = {}  # version -> its last manifest (bounded, see _take)
        self._held: _Held | None = None  # kept once deltas are in use (snapshot_every > 1, or a delta seen)
        self._deltas_seen = weights_cfg.snapshot_every > 1
        self.invalid_manifests = 0
        self.rebuilt_from: deque[tuple[int, int]] = deque(maxlen=64)  # (version, rebuilt from), newest deltas

    @property
    def latest(self) -> WeightsManifest | None:
        """The newest manifest seen so far, without polling."""
        return self._latest

    def candidates(self, newer_than: int) -> list[WeightsManifest]:
        """The manifests seen of versions above ``newer_than``, newest first (the last record of each version)."""
        return [self._recent[v] for v in sorted(self._recent, reverse=True) if v > newer_than]

    def poll_latest(self, timeout_s: float = 0.0, newer_than: int | None = None) -> WeightsManifest | None:
        """Read new manifests; return the newest seen so far (``None`` before the first one).

        With ``timeout_s=0`` it makes one non-blocking pass. Otherwise it returns as soon as it has caught up with
        the topic's high-water mark (or, with ``newer_than``, once a version above it was seen), and at the
        latest after ``timeout_s``. Equal versions: the later record wins (a re-published version).
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            self._poll_once(deadline)
            if self._satisfied(newer_than) or time.monotonic() >= deadline:
                return self._latest

    def _poll_once(self, deadline: float) -> None:
        remaining = max(0.0, deadline - time.monotonic())
        if not self._parts and not self._assign():
            time.sleep(min(remaining, _POLL_S))  # the weights topic does not exist yet
            return
        for rec in self._reader.poll(min(remaining, _POLL_S)):
            self._take(rec)

    def _assign(self) -> bool:
        try:
            self._parts = self._reader.partitions(self._topic, timeout_s=0)
        except KeyError:
            return False
        self._reader.follow({tp: None for tp in self._parts})  # from the first record
        return True

    def _satisfied(self, newer_than: int | None) -> bool:
        if newer_than is not None:
            return self._latest is not None and self._latest.version > newer_than
        if not self._parts:
            return False
        marks = [self._reader.highwater(*tp) for tp in self._parts]
        return all(mark is not None and self._reader.position(*tp) >= mark for tp, mark in zip(self._parts, marks))

    def _take(self, rec: Any) -> None:
        try:
            manifest = decode(rec.value, "weights_manifest")
        except SchemaError as exc:
            self.invalid_manifests += 1
            log.warning("skipping invalid record %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, exc)
            return
        if self._latest is None or manifest.version >= self._latest.version:
            self._latest = manifest
        self._recent[manifest.version] = manifest
        self._deltas_seen = self._deltas_seen or manifest.is_delta
        keep = 2 * self.cfg.keep_last + self.cfg.snapshot_every
        if len(self._recent) > keep:
            for version in sorted(self._recent)[:-keep]:
                del self._recent[version]

    def fetch(self, manifest: WeightsManifest) -> dict[str, torch.Tensor]:
        """Every tensor of ``manifest``'s version, verified; raises WeightsError instead of returning a part.
        The tensors are views of the verified payload (one buffer, or the mapped store file)."""
        started = time.monotonic()
        if manifest.mode not in ("inline", "store"):
            raise WeightsError(manifest.version, f"unknown mode {manifest.mode!r}")
        flat = self._rebuild(manifest) if manifest.is_delta else self._full_payload(manifest)
        if self._deltas_seen:
            self._held = _Held(manifest.version, manifest.sha256, flat)
        log.info("fetched weights v%d (%s%s, %d of %d bytes) in %.3fs", manifest.version, manifest.mode,
                 f", delta against v{manifest.delta_base}" if manifest.is_delta else "", manifest.sent_bytes,
                 manifest.total_bytes, time.monotonic() - started)
        return tensor_views(manifest.tensors, flat)

    def _full_payload(self, manifest: WeightsManifest) -> np.ndarray:
        if manifest.mode == "inline":
            return assemble(manifest, self._read_chunks_of(manifest), digests_checked=True)
        return payload_from_store(manifest, path_from_uri(manifest.version, manifest.store_uri or ""))

    def _rebuild(self, manifest: WeightsManifest) -> np.ndarray:
        """The payload of a delta version: its chain applied to the held payload or to the snapshot before it."""
        start, links = self._chain(manifest, use_held=True)
        try:
            return self._apply_chain(start, links)
        except WeightsError as exc:
            if not isinstance(start, _Held):
                raise
            log.warning("weights v%d: rebuilding from the held v%d failed (%s); rebuilding from the snapshot",
                        manifest.version, start.version, exc.problem)
            try:
                return self._apply_chain(*self._chain(manifest, use_held=False))
            except WeightsError:
                raise exc from None  # the first failure names what is wrong with this version

    def _chain(self, manifest: WeightsManifest,
               use_held: bool) -> tuple[_Held | WeightsManifest, list[WeightsManifest]]:
        """Where a rebuild of ``manifest`` starts (the held payload, or a snapshot's manifest) and the deltas to
        apply to it, oldest first; WeightsError when a link's manifest is unknown or has another digest."""
        links: list[WeightsManifest] = []
        current = manifest
        while current.is_delta:
            links.append(current)
            held = self._held
            if use_held and held is not None and (held.version, held.sha256) == (
                    current.delta_base, current.delta_base_sha256):
                return held, links[::-1]
            base = self._recent.get(current.delta_base)  # type: ignore[arg-type]
            if base is None or base.sha256 != current.delta_base_sha256:
                seen = "was not seen (garbage-collected?)" if base is None else "has another sha256"
                raise WeightsError(manifest.version, f"cannot rebuild: the delta chain needs v{current.delta_base} "
                                                     f"(sha256 {current.delta_base_sha256}), whose manifest {seen}")
            current = base
        return current, links[::-1]

    def _apply_chain(self, start: _Held | WeightsManifest, links: list[WeightsManifest]) -> np.ndarray:
        flat = start.flat if isinstance(start, _Held) else self._full_payload(start)
        for link in links:
            flat = apply_delta(link.version, flat, self._delta_blob(link))
            check_payload(link, flat)
        self.rebuilt_from.append((links[-1].version, start.version))
        return flat

    def _delta_blob(self, manifest: WeightsManifest) -> np.ndarray | bytes:
        """The compressed delta of ``manifest``, its size and digest checked."""
        if manifest.mode == "inline":
            blob: np.ndarray | bytes = gather(manifest, self._read_chunks_of(manifest), digests_checked=True)
        else:
            path = path_from_uri(manifest.version, manifest.store_uri or "")
            try:
                blob = path.read_bytes()
            except FileNotFoundError:
                raise WeightsError(manifest.version, f"delta file {path} not found (garbage-collected?)") from None
            except OSError as exc:
                raise WeightsError(manifest.version, f"cannot read delta file {path}: {exc}") from None
        check_delta(manifest, blob)
        return blob

    def _read_chunks_of(self, manifest: WeightsManifest) -> list[WeightsChunk]:
        """Every chunk record of ``manifest``'s version topic, bounded by ``fetch_timeout_s``."""
        deadline = time.monotonic() + self.cfg.fetch_timeout_s
        reader = self._transport.reader(bulk=True)  # many chunks per fetch response, not one
        try:
            try:
                parts = reader.partitions(manifest.chunks_topic, timeout_s=min(TOPIC_WAIT_S, _left(deadline)))
            except KeyError:
                raise WeightsError(manifest.version, f"chunk topic {manifest.chunks_topic} does not exist "
                                                     f"(garbage-collected, or never created)") from None
            chunks: list[WeightsChunk] = []
            for tp in parts:
                chunks.extend(self._read_chunks(reader, tp, manifest, deadline))
        finally:
            reader.close()
        return chunks

    def _read_chunks(self, reader, tp: tuple[str, int], manifest: WeightsManifest,
                     deadline: float) -> list[WeightsChunk]:
        """Chunk records of one partition from offset 0 up to the high-water mark known when the read began."""
        version, (topic, partition) = manifest.version, tp
        try:
            end = reader.highwaters([tp], timeout_s=_left(deadline))[tp]
        except TimeoutError as exc:
            raise WeightsError(version, f"no fetch response from {topic}: {exc}") from None
        reader.follow({tp: 0})
        chunks: list[WeightsChunk] = []
        while reader.position(topic, partition) < end:
            if time.monotonic() >= deadline:
                raise WeightsError(version, f"gave up after {self.cfg.fetch_timeout_s}s reading {topic}"
                                            f"[{partition}] at offset {reader.position(topic, partition)} of {end}")
            for rec in reader.poll(_POLL_S):
                if rec.offset < end:
                    chunks.append(_decode_chunk(version, rec))
        return chunks

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> WeightsReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _decode_chunk(version: int, rec: Any) -> WeightsChunk:
    try:
        return decode(rec.value, "weights_chunk")
    except SchemaError as exc:
        raise WeightsError(version, f"chunk record {rec.topic}[{rec.partition}]@{rec.offset} rejected: "
                                    f"{exc}") from None


def path_from_uri(version: int, uri: str) -> Path:
    """The local path of a ``store_uri``: an absolute path or a ``file://`` URI (host empty or localhost)."""
    if uri.startswith("file:"):
        parsed = urllib.parse.urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise WeightsError(version, f"store_uri {uri!r} names host {parsed.netloc!r}; only local paths work")
        return Path(urllib.request.url2pathname(parsed.path))
    if os.path.isabs(uri):
        return Path(uri)
    raise WeightsError(version, f"unsupported store_uri {uri!r} (expected an absolute path or a file:// URI)")
