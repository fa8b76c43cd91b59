"""ops/wire_reader.py, the reader that follows docs/wire-format.md with nothing but msgpack, on bytes we encoded.

Input is what ``kcat -C -e -f '%R%s'`` writes: each value after its length as a 4-byte big-endian signed int.
The reader runs as a separate interpreter that can import only the standard library and msgpack.
"""

from __future__ import annotations

import ast
import base64
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from support.messages import MAKERS, make_dead_letter, make_manifest, make_rollout, make_scored
from support.paths import REPO_ROOT

from schemas import encode, to_jsonable

READER = REPO_ROOT / "ops" / "wire_reader.py"


@pytest.fixture(scope="module")
def isolated(tmp_path_factory):
    """A directory with a copy of the reader and a library path holding only the msgpack package."""
    root = tmp_path_factory.mktemp("reader")
    shutil.copy(READER, root / "wire_reader.py")
    (root / "lib").mkdir()
    (root / "lib" / "msgpack").symlink_to(Path(msgpack.__file__).parent)
    return root


def run_reader(isolated: Path, stdin: bytes, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(isolated / "lib")}
    return subprocess.run([sys.executable, "-S", str(isolated / "wire_reader.py"), *args], input=stdin,
                          capture_output=True, env=env, cwd=isolated, timeout=60)


def framed(*values: bytes | None) -> bytes:
    return b"".join(struct.pack(">i", -1) if v is None else struct.pack(">i", len(v)) + v for v in values)


def read_lines(isolated: Path, stdin: bytes, *args: str) -> list:
    done = run_reader(isolated, stdin, *args)
    assert done.returncode == 0, done.stderr.decode()
    return [json.loads(line) for line in done.stdout.decode().splitlines()]


def test_reader_imports_only_the_standard_library_and_msgpack():
    tree = ast.parse(READER.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported - {"msgpack"} <= set(sys.stdlib_module_names)
    assert "msgpack" in imported and len(READER.read_text().splitlines()) <= 60


def test_rollout_decoded_field_by_field(isolated):
    msg = make_rollout()
    (out,) = read_lines(isolated, framed(encode(msg)))
    assert (out["kind"], out["schema_version"]) == ("rollout", 1)
    assert out["response_token_ids"] == [1, 256, 65536, 3]
    assert out["prompt_token_ids"] == [7, 8, 9]
    assert out["behavior_logprobs"] == [-0.25, -1.5, 0.0, -3.0]
    assert out["token_policy_versions"] == [6, 5, 6, 6]
    for name in ("rollout_id", "prompt_id", "group_id", "epoch", "sample_index", "group_size", "finish_reason",
                 "producer_id", "prompt_text", "response_text", "answer", "metadata", "attempt", "temperature",
                 "timings"):
        assert out[name] == getattr(msg, name), name


def test_float32_values_survive_exactly(isolated):
    logprobs = -np.random.default_rng(0).random(4).astype(np.float32)
    (out,) = read_lines(isolated, framed(encode(make_rollout(behavior_logprobs=logprobs))))
    assert np.array_equal(np.array(out["behavior_logprobs"], np.float32), logprobs)
    assert out["behavior_logprobs"] == [float(x) for x in logprobs]


def test_nested_rollout_manifest_and_bytes(isolated):
    scored, (_, manifest), letter = make_scored(), make_manifest(), make_dead_letter()
    out_scored, out_manifest, out_letter = read_lines(isolated, framed(encode(scored), encode(manifest),
                                                                      encode(letter)))
    assert out_scored["rollout"]["kind"] == "rollout"
    assert out_scored["rollout"]["behavior_logprobs"] == [-0.25, -1.5, 0.0, -3.0]
    assert out_scored["ref_logprobs"] == [-0.5, -1.0, -0.125, -2.0] and out_scored["reward"] == 1.25
    assert out_manifest["tensors"][1] == {"name": "head.bias", "dtype": "F16", "shape": [3], "offset": 48,
                                          "nbytes": 6}
    assert out_manifest["sha256"] == manifest.sha256 and out_manifest["chunks_topic"] == manifest.chunks_topic
    assert base64.b64decode(out_letter["raw_value"]) == letter.raw_value
    assert base64.b64decode(out_letter["raw_key"]) == letter.raw_key


def test_every_kind_matches_the_project_json_view_and_null_values_pass(isolated):
    messages = [make() for make in MAKERS.values()]
    out = read_lines(isolated, framed(encode(messages[0]), None, *(encode(m) for m in messages[1:])))
    assert out[1] is None
    assert [o for i, o in enumerate(out) if i != 1] == [json.loads(json.dumps(to_jsonable(m))) for m in messages]


def test_raw_mode_and_file_argument(isolated, tmp_path):
    value = encode(make_rollout())
    (raw_out,) = read_lines(isolated, value, "--raw")
    assert raw_out["rollout_id"] == "p0:1:2"
    path = tmp_path / "values.bin"
    path.write_bytes(framed(value, value))
    assert [o["rollout_id"] for o in read_lines(isolated, b"", str(path))] == ["p0:1:2", "p0:1:2"]


def test_multidimensional_and_small_dtypes_are_nested(isolated):
    value = msgpack.packb({"kind": "probe", "grid": {"dtype": "<i2", "shape": [2, 3],
                                                     "data": np.arange(6, dtype="<i2").tobytes()},
                           "half": {"dtype": "<f2", "shape": [2], "data": np.array([0.5, -2], "<f2").tobytes()},
                           "bytes": {"dtype": "|u1", "shape": [3], "data": b"\x00\x7f\xff"}}, use_bin_type=True)
    (out,) = read_lines(isolated, framed(value))
    assert out == {"kind": "probe", "grid": [[0, 1, 2], [3, 4, 5]], "half": [0.5, -2.0], "bytes": [0, 127, 255]}


@pytest.mark.parametrize("stdin, message", [(b"\x00\x00", "truncated length prefix"),
                                            (struct.pack(">i", 10) + b"abc", "truncated value (3 of 10 bytes)")])
def test_truncated_input_fails_loudly(isolated, stdin, message):
    done = run_reader(isolated, stdin)
    assert done.returncode != 0 and message in done.stderr.decode()
