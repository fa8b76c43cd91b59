"""The e2e leak check's search (tests/support/leaks.py) is exact where a person reads text and blind where short
needles match binary data by chance: the flake of issue 45 ("133+1" inside a report's base64 PNG) cannot recur, and
a leak in the page's text, a PNG's text chunk, a safetensors header or a log is still found."""

from __future__ import annotations

import base64
import struct
import zlib

import torch
from safetensors.torch import save_file
from support.leaks import grep_leaks


def _png(text_chunks: dict[str, str]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
    texts = b"".join(chunk(b"tEXt", k.encode() + b"\0" + v.encode()) for k, v in text_chunks.items())
    return b"\x89PNG\r\n\x1a\n" + header + texts + chunk(b"IDAT", zlib.compress(b"\0\0")) + chunk(b"IEND", b"")


def test_needles_in_base64_and_tensor_bytes_are_not_leaks_but_text_is(tmp_path):
    run = tmp_path / "run"
    (run / "report").mkdir(parents=True)
    chance = "133+1"  # valid base64 characters: it occurs in embedded images by chance
    payload = base64.b64encode(b"\xdf\x7d\xf8" * 40).decode() + "133+1AAAA"
    assert chance in payload
    (run / "report" / "report.html").write_text(
        f'<html><img alt="panel" src="data:image/png;base64,{payload}"><p>shown: 12+34=</p></html>')
    (run / "report" / "plot.png").write_bytes(_png({"Title": "77+88= in a title"}))
    weights = run / "w.safetensors"
    save_file({"t": torch.frombuffer(bytearray(b"..99+1.."), dtype=torch.uint8)}, str(weights),
              metadata={"note": "55+66= in metadata"})
    assert b"99+1" in weights.read_bytes()  # in the tensor bytes, where it means nothing
    log = tmp_path / "role.err"
    log.write_text("step 3: response 44+55=\n")
    needles = [chance, "12+34=", "77+88=", "55+66=", "44+55=", "99+1"]

    found = grep_leaks(run, log, needles=needles)

    hits = {line.rsplit(":", 1)[1] for line in found.splitlines()}
    assert hits == {"12+34=", "77+88=", "55+66=", "44+55="}, found
    for _ in range(20):  # the same files, the same answer: nothing left to chance
        assert grep_leaks(run, log, needles=needles) == found
