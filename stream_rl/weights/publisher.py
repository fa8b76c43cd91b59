"""The trainer side of the weight broadcast: publish a version, garbage-collect old ones.

Consumes: a state dict (CPU copies that do not alias the live model, e.g. from
``stream_rl.models.loading.state_dict_for_broadcast``), the trainer's :class:`Transport` and :class:`Sink`.
Produces: per version either chunk records on ``names.weights_chunks(version)`` (inline) or a safetensors file
``{store_dir}/v{version:08d}.safetensors`` (store), then one :class:`WeightsManifest` on ``names.weights``,
key ``str(version)``.
Guarantees (the order is the contract; see docs/weights.md)::

    inline: create chunk topic (1 partition) ─> send chunks ─> sink.flush() (acked) ─> send manifest ─> flush
    store:  save_file to a tmp file (streamed, hashed once through a memory map) ─> validate the manifest
            ─> fsync file ─> rename to v{N:08d}.safetensors ─> fsync dir ─> send manifest ─> flush

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
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from schemas import WeightsManifest, validate
from stream_rl import failpoints
from stream_rl.fsutil import fsync_path
from stream_rl.weights.config import WeightsConfig
from stream_rl.weights.payload import (
    Payload, StoredPayload, build_manifest, make_chunks, payload_size, prepare, save_store_file, serialize,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CHUNK_ENVELOPE_BYTES = 16 * 1024
"""Room left in a record for the chunk's msgpack envelope, key, trace headers and Kafka record overhead."""
FLUSH_EVERY_BYTES = 16 << 20
"""Inline sends wait for acks after this many bytes, so the producer's buffer never has to hold a whole model."""
_UNKNOWN_TOPIC = 3  # Kafka error code UNKNOWN_TOPIC_OR_PARTITION: the topic is already gone
STORE_FILE = re.compile(r"^v(\d{8})\.safetensors$")
"""A complete store-mode version file (group 1: the version); written by rename, so never partial."""
STORE_TMP = re.compile(r"^\.v(\d{8})\.safetensors\.[0-9a-f]+\.tmp$")
"""A store-mode file being written (group 1: the version)."""


def choose_mode(cfg: WeightsConfig, total_bytes: int) -> str:
    """``inline`` or ``store`` for a payload of ``total_bytes`` under ``cfg.mode``."""
    if cfg.mode == "auto":
        return "store" if total_bytes > cfg.inline_max_bytes else "inline"
    return cfg.mode


def store_file_name(version: int) -> str:
    return f"v{version:08d}.safetensors"


class WeightsPublisher:
    """Publishes policy versions for one trainer (not thread-safe: one publish at a time)."""

    def __init__(self, transport, sink, weights_cfg: WeightsConfig, trainer_id: str):
        self._transport = transport
        self._sink = sink
        self.cfg = weights_cfg
        self.trainer_id = trainer_id
        self._topics_ready = False  # the run's topics (the weights topic among them) exist
        run_dir = Path(transport.cfg.run_dir)
        self.store_dir = Path(weights_cfg.store_dir) if weights_cfg.store_dir is not None else run_dir / "weights"
        limit = transport.cfg.kafka.max_request_size
        if weights_cfg.mode != "store" and weights_cfg.chunk_size + CHUNK_ENVELOPE_BYTES > limit:
            raise ValueError(f"weights.chunk_size {weights_cfg.chunk_size} + {CHUNK_ENVELOPE_BYTES} bytes of "
                             f"envelope exceeds kafka.max_request_size {limit}")

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int, step: int) -> WeightsManifest:
        """Make ``state_dict`` available as ``version`` (after optimizer step ``step``); return its manifest."""
        started = time.monotonic()
        tensors = prepare(state_dict)
        mode = choose_mode(self.cfg, payload_size(tensors))
        if mode == "inline":
            payload = serialize(tensors)
            topic = self._transport.names.weights_chunks(version)
            manifest = validate(self._manifest(payload, version, step, mode, chunks_topic=topic))
            self._send_chunks(payload, manifest)
        else:
            if not self._topics_ready:
                self._transport.ensure_topics()
                self._topics_ready = True
            path = (self.store_dir / store_file_name(version)).resolve()
            payload, manifest = self._write_file(tensors, path, version, step)
        failpoints.hit("weights.mid_publish")  # recovery drills: the payload exists, its manifest does not
        manifest = dataclasses.replace(manifest, created_at=time.time())  # the payload is durable now
        self._sink.send(self._transport.names.weights, manifest, key=str(version))
        self._sink.flush()
        log.info("published weights v%d (step %d, %s, %d bytes, %d tensors) in %.3fs", version, step, mode,
                 payload.total_bytes, len(payload.tensors), time.monotonic() - started)
        return manifest

    def _manifest(self, payload: Payload | StoredPayload, version: int, step: int, mode: str,
                  **where: str) -> WeightsManifest:
        return build_manifest(payload, version=version, step=step, mode=mode, chunk_size=self.cfg.chunk_size,
                              trainer_id=self.trainer_id, **where)

    def _send_chunks(self, payload: Payload, manifest: WeightsManifest) -> None:
        topic = manifest.chunks_topic
        self._transport.ensure_topics(extra={topic: 1})  # the run's topics (weights included) and this one
        self._topics_ready = True
        unflushed = 0
        for chunk in make_chunks(payload, manifest.version, manifest.chunk_size):
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
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            payload = save_store_file(tensors, tmp)
            manifest = validate(self._manifest(payload, version, step, "store", store_uri=path.as_uri()))
            fsync_path(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_path(path.parent)
        return payload, manifest

    def collect_garbage(self, keep_last: int | None = None) -> list[int]:
        """Delete chunk topics and store files of all versions but the newest ``keep_last`` (default
        ``cfg.keep_last``); return the versions removed, oldest first."""
        keep = self.cfg.keep_last if keep_last is None else keep_last
        if keep < 1:
            raise ValueError(f"keep_last must be >= 1 (the newest version is in use), got {keep}")
        admin = self._transport.admin()
        try:
            topics = self._chunk_topics(admin.list_topics())
            files = self._store_files()
            versions = sorted(set(topics) | set(files))
            doomed = versions[:-keep] if len(versions) > keep else []
            self._delete_topics(admin, [topics[v] for v in doomed if v in topics])
        finally:
            admin.close()
        for version in doomed:
            if version in files:
                files[version].unlink(missing_ok=True)
        self._remove_abandoned_tmp(max(versions, default=-1))
        if doomed:
            log.info("weights garbage collection removed versions %s", doomed)
        return doomed

    def _chunk_topics(self, topic_names: list[str]) -> dict[int, str]:
        head = self._transport.names.weights + ".v"
        return {int(name[len(head):]): name for name in topic_names
                if name.startswith(head) and name[len(head):].isdigit()}

    def _store_files(self) -> dict[int, Path]:
        if not self.store_dir.is_dir():
            return {}
        found = {}
        for path in self.store_dir.iterdir():
            match = STORE_FILE.match(path.name)
            if match:
                found[int(match.group(1))] = path
        return found

    def _delete_topics(self, admin, names: list[str]) -> None:
        if not names:
            return
        result = admin.delete_topics(names, raise_errors=False)
        for item in result.get("topics", []):
            code = item.get("error_code", 0)
            if code not in (0, _UNKNOWN_TOPIC):
                raise RuntimeError(f"deleting weights topic {item.get('name')} failed: error {code} "
                                   f"{item.get('error_message')}")

    def _remove_abandoned_tmp(self, newest: int) -> None:
        """Temporary files of versions up to the newest one are left over from crashed writes."""
        if not self.store_dir.is_dir():
            return
        for path in self.store_dir.iterdir():
            match = STORE_TMP.match(path.name)
            if match and int(match.group(1)) <= newest:
                path.unlink(missing_ok=True)
