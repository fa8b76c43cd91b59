"""Atomic, pickle-free trainer checkpoints: write a temporary directory, fsync, rename to ``step-{step:08d}``.

Consumes: an engine (anything with ``save(dir)``: weights and optimizer state), the trainer's JSON state (step,
policy version, KL coefficient, counters), the consumed offsets per partition and the dedup ledger.
Produces, in ``{root}/step-{step:08d}/``::

    model.safetensors       weights (engine.save)           optimizer.safetensors  AdamW moments per parameter
    optimizer.json          AdamW step counts + hyper-params rng.safetensors       torch and numpy RNG arrays
    ledger.json             trained rollout ids, re-queued attempts, batcher counters
    trainer.json            step, version, offsets, trainer state, python/numpy RNG scalars  (written LAST)

Guarantees:
- No pickle: tensors go to safetensors, everything else to JSON (``torch.save`` is never used). The learning-rate
  schedule is a pure function of the step, so its "state" is the step. An optimizer whose state holds anything
  but tensors and JSON scalars is refused with :class:`CheckpointError` (AdamW is fully representable).
- Atomic: files are written into ``{root}/.tmp-step-*``, every file and the directory are fsynced, then the
  directory is renamed into place and ``root`` fsynced. A crash leaves either no ``step-*`` directory or a complete
  one; :func:`latest_checkpoint` ignores temporary directories and any directory without ``trainer.json``.
- Pruning renames a victim to ``.del-*`` before deleting it, so a crash mid-delete never leaves a partial
  ``step-*`` directory behind.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from stream_rl.storage.fsync import fsync_path

_NAME = re.compile(r"^step-(\d{8})$")
TRAINER_FILE = "trainer.json"
LEDGER_FILE = "ledger.json"
RNG_FILE = "rng.safetensors"
TMP_PREFIX, DEL_PREFIX = ".tmp-", ".del-"  # a save in progress; a directory being deleted
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def write_tensors(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """``tensors`` to a safetensors file, fsynced."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path))
    fsync_path(path)


def read_tensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"missing checkpoint file {path}")
    return load_file(str(path))


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON, fsynced; NaN/inf are refused (they are not JSON)."""
    path.write_text(json.dumps(obj, sort_keys=True, allow_nan=False))
    fsync_path(path)


def read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"missing checkpoint file {path}")
    return json.loads(path.read_text())


def capture_rng() -> tuple[dict[str, Tensor], dict[str, Any]]:
    """torch, numpy and python RNG states as (tensors, JSON)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64))}
    meta = {"numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next}}
    return tensors, meta


def restore_rng(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    n = meta["numpy"]
    np.random.set_state((n["kind"], tensors["numpy_keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    p = meta["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))


def _offsets_json(offsets: Mapping[tuple[str, int], int]) -> list[list[Any]]:
    return [[topic, int(part), int(off)] for (topic, part), off in sorted(offsets.items())]


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint holds besides the engine files (load those with ``engine.load(path)``)."""

    path: Path
    step: int
    version: int
    offsets: dict[tuple[str, int], int]
    ledger: dict[str, Any]
    state: dict[str, Any]
    rng_tensors: dict[str, Tensor]
    rng_meta: dict[str, Any]

    def restore_rng(self) -> None:
        restore_rng(self.rng_tensors, self.rng_meta)


def save_checkpoint(root: str | os.PathLike, *, step: int, version: int, engine: Any,
                    offsets: Mapping[tuple[str, int], int], ledger: Mapping[str, Any],
                    state: Mapping[str, Any]) -> Path:
    """Write ``{root}/step-{step:08d}`` atomically (module docstring); returns its path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    if final.exists():
        raise CheckpointError(f"checkpoint {final} already exists")
    tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        engine.save(tmp)
        rng_tensors, rng_meta = capture_rng()
        write_tensors(tmp / RNG_FILE, rng_tensors)
        write_json(tmp / LEDGER_FILE, dict(ledger))
        write_json(tmp / TRAINER_FILE, {"format": FORMAT, "step": step, "version": version,
                                        "offsets": _offsets_json(offsets), "state": dict(state), "rng": rng_meta})
        fsync_path(tmp)
        os.rename(tmp, final)
        fsync_path(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / TRAINER_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, or None (temporary and incomplete directories are ignored)."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read the non-engine parts of a checkpoint directory."""
    path = Path(path)
    meta = read_json(path / TRAINER_FILE)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {meta.get('format')!r}")
    offsets = {(topic, int(part)): int(off) for topic, part, off in meta["offsets"]}
    return Checkpoint(path=path, step=int(meta["step"]), version=int(meta["version"]), offsets=offsets,
                      ledger=read_json(path / LEDGER_FILE), state=meta["state"],
                      rng_tensors=read_tensors(path / RNG_FILE), rng_meta=meta["rng"])


def prune_checkpoints(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints and any leftover temporary directory.

    Call it from the (single) writer only, after a save: then no temporary directory is in progress.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    victims = complete_checkpoints(root)[:-keep]
    if root.is_dir():
        victims += [p for p in root.iterdir() if p.is_dir() and p.name.startswith((TMP_PREFIX, DEL_PREFIX))]
    for path in victims:
        delete_checkpoint_dir(path)
    return victims


def delete_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint (or temporary) directory: renamed to ``.del-*`` first, so a crash mid-delete never
    leaves a partial ``step-*`` that would look like a checkpoint."""
    doomed = path
    if not path.name.startswith(DEL_PREFIX):
        doomed = path.with_name(f"{DEL_PREFIX}{path.name}-{uuid.uuid4().hex[:6]}")
        os.rename(path, doomed)
    shutil.rmtree(doomed)
