"""Search a run's files for text that must not be there (sample texts, a secret), as a person or a log reader
would see them: exact, but not inside bytes nobody reads as text.

Consumes: a run directory, extra files (a role's stdout/stderr) and needles (strings).
Produces: :func:`grep_leaks` -> the matches, one ``path:needle`` line each ("" when none).
Guarantees: every file is searched whole (``grep -rFao``) except where short needles match binary data by chance:
- ``*.safetensors``: only the JSON header (names, dtypes, metadata: where text could be written). AdamW's
  second moments are floats whose high bytes are ASCII digits, so "72+78=" turns up in tensor bytes by chance.
- ``*.html``: the text with every ``data:...;base64,...`` URI taken out (an embedded PNG's base64 once held the
  5-character needle "133+1"); the page's own text, attributes and scripts are searched.
- ``*.png``: only its text chunks (tEXt, zTXt as stored, iTXt), never its compressed pixels.
"""

from __future__ import annotations

import re
import struct
import subprocess
from pathlib import Path

DATA_URI = re.compile(rb"data:[A-Za-z0-9.+/-]*(?:;[A-Za-z0-9=.+-]*)*;base64,[A-Za-z0-9+/=\s]*")
SPECIAL = ("*.safetensors", "*.html", "*.png")


def grep_leaks(run_dir: Path, *files: Path, needles: list[str]) -> str:
    """Every needle found in the searchable text of ``run_dir``'s files and ``files`` (module docstring)."""
    patterns = run_dir.parent / "needles.txt"
    patterns.write_text("".join(n + "\n" for n in needles))
    excludes = [f"--exclude={p}" for p in SPECIAL]
    out = subprocess.run(["grep", "-rFao", *excludes, "-f", str(patterns), str(run_dir), *map(str, files)],
                         capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr  # 1: nothing matched
    found = [out.stdout]
    for pattern, text_of in (("*.safetensors", safetensors_header), ("*.html", html_text), ("*.png", png_text)):
        for path in sorted(run_dir.rglob(pattern)):
            text = text_of(path).decode("utf-8", "replace")
            found += [f"{path} ({pattern[2:]} text):{n}\n" for n in needles if n in text]
    return "".join(found)


def safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file: an 8-byte little-endian length, then that many bytes."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return f.read(size)


def html_text(path: Path) -> bytes:
    return DATA_URI.sub(b"data:,", path.read_bytes())


def png_text(path: Path) -> bytes:
    """The payloads of a PNG's text chunks (tEXt, zTXt, iTXt), concatenated with newlines."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, texts = 8, []
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind in (b"tEXt", b"zTXt", b"iTXt"):
            texts.append(data[pos + 8:pos + 8 + length])
        pos += 12 + length
    return b"\n".join(texts)
