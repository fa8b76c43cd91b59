"""Prompt files for the tests: JSON lines written as a user's tools write them.

Consumes: a path and records. Produces: :func:`write_jsonl` (objects dumped as JSON, strings written verbatim for
malformed lines), returning the path."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, lines: list) -> Path:
    """Objects are dumped as JSON; strings are written verbatim (for malformed lines)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
                    encoding="utf-8")
    return path
