"""Durable file-system writes: fsync helpers for the write-to-temp, fsync, rename pattern.

Used by checkpoints, model directories, the demo build and the weights store; nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync one file, or one directory (making the creations and renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root``, so a following rename publishes durable content."""
    for dirpath, _, filenames in os.walk(Path(root)):
        for filename in filenames:
            fsync_path(os.path.join(dirpath, filename))
        fsync_path(Path(dirpath))
