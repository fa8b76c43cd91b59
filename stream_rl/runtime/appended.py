"""Following a JSON-lines file that another process appends to (``evals.jsonl``, written by the evaluator).

Consumes: a path that may not exist yet. Produces: on each call, the whole lines appended since the previous call.
Guarantees: a torn last line (being written, or cut by a kill -9) is not returned until its newline arrives; every
whole line is returned once; a missing file gives no line.
"""

from __future__ import annotations

from pathlib import Path


class AppendedLines:
    """The whole lines appended to ``path`` since the last :meth:`new_lines` call (bytes, without newlines)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = Path(path), 0

    def new_lines(self) -> list[bytes]:
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        return whole.splitlines()
