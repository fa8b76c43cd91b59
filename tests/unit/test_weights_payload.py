"""Weights without a broker: the payload and manifest format, chunking and its checks, mode choice, store paths
and the receiver's refusals of corrupted or mixed payloads."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from support.weights import assert_same_tensors, flip_byte, manifest_for

from schemas import SchemaError, WeightsChunk, decode, encode
from stream_rl.cli.config import load_config
from stream_rl.transport.client import Transport
from stream_rl.weights import WeightsConfig
from stream_rl.weights.payload import (
    WeightsError,
    assemble,
    make_chunks,
    prepare,
    save_store_file,
    serialize,
    sha256_hex,
    split,
    tensors_from_chunks,
    tensors_from_store,
)
from stream_rl.weights.publisher import WeightsPublisher, choose_mode
from stream_rl.weights.receiver import path_from_uri

torch.set_num_threads(1)


def mixed_state() -> dict[str, torch.Tensor]:
    """Every common dtype, a scalar, an empty tensor and a non-contiguous view."""
    torch.manual_seed(1)
    return {
        "w.f32": torch.randn(5, 7),
        "w.bf16": torch.randn(3, 11).to(torch.bfloat16),
        "w.f16": torch.randn(13).to(torch.float16),
        "step.i64": torch.tensor(12345678901, dtype=torch.int64),
        "mask.bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }

def _file(tmp_path, data: bytes):
    path = tmp_path / "v00000007.safetensors"
    path.write_bytes(data)
    return path


def test_payload_is_the_data_section_with_payload_relative_offsets():
    state = mixed_state()
    payload = serialize(state)
    data = bytes(payload.data)
    assert payload.sha256 == hashlib.sha256(data).hexdigest()
    assert payload.total_bytes == len(data) == sum(e.nbytes for e in payload.tensors)
    assert payload.file_bytes[payload.data_start:] == data
    end = 0
    for entry in payload.tensors:  # sorted, contiguous from 0
        assert entry.offset == end
        end = entry.end
        raw = state[entry.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert data[entry.offset:entry.end] == raw, entry.name
    by_name = {e.name: e for e in payload.tensors}
    assert (by_name["w.bf16"].dtype, by_name["w.bf16"].shape, by_name["w.bf16"].nbytes) == ("BF16", (3, 11), 66)
    assert (by_name["empty"].nbytes, by_name["step.i64"].shape) == (0, ())


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 149, 10_000])
def test_chunk_unchunk_identity_in_any_read_order(chunk_size):
    payload = serialize(mixed_state())
    manifest = manifest_for(payload, chunk_size=chunk_size)
    chunks = list(make_chunks(payload.data, manifest.version, chunk_size))
    assert len(chunks) == manifest.chunk_count == -(-payload.total_bytes // chunk_size)
    assert all(c.sha256 == sha256_hex(c.data) and c.count == len(chunks) for c in chunks)
    assert b"".join(split(payload.data, chunk_size)) == bytes(payload.data)
    assert bytes(assemble(manifest, chunks[::-1])) == bytes(payload.data)


def test_a_republished_version_uses_the_last_copy_of_each_chunk():
    payload = serialize({"w": torch.arange(100, dtype=torch.float32)})
    crashed = serialize({"w": torch.zeros(100)})  # an earlier attempt at the same version, other weights
    manifest = manifest_for(payload, chunk_size=64)
    first_try = list(make_chunks(crashed.data, manifest.version, 64))[:4]
    retry = list(make_chunks(payload.data, manifest.version, 64))
    assert bytes(assemble(manifest, first_try + retry)) == bytes(payload.data)
    with pytest.raises(WeightsError, match="weights v7: payload sha256"):  # the stale copies last: rejected
        assemble(manifest, retry + first_try)


def test_decode_round_trip_keeps_values_and_dtypes(tmp_path):
    state = mixed_state()
    payload = serialize(state)
    manifest = manifest_for(payload)
    assert_same_tensors(tensors_from_chunks(manifest, make_chunks(payload.data, 7, 40)), state)
    store_manifest = manifest_for(payload, store_uri="/w/v00000007.safetensors")
    assert_same_tensors(tensors_from_store(store_manifest, _file(tmp_path, payload.file_bytes)), state)


def test_a_store_file_is_written_straight_to_disk_and_read_back_through_one_mapping(tmp_path):
    """save_store_file gives the same file, index and digest as serialize; the tensors tensors_from_store returns
    are copy-on-write views of the mapping it hashed: bit-exact, and writing to one never reaches the file."""
    state = mixed_state()
    payload = serialize(state)
    path = tmp_path / "v.safetensors"
    stored = save_store_file(prepare(state), path)
    assert path.read_bytes() == payload.file_bytes
    assert (stored.tensors, stored.total_bytes, stored.sha256) == (payload.tensors, payload.total_bytes,
                                                                   payload.sha256)
    manifest = manifest_for(payload, store_uri=path.as_uri())
    tensors = tensors_from_store(manifest, path)
    assert_same_tensors(tensors, state)
    assert tensors["w.bf16"].view(torch.int16).equal(state["w.bf16"].view(torch.int16))  # bit for bit
    tensors["w.f32"].add_(1.0)
    assert path.read_bytes() == payload.file_bytes and tensors_from_store(manifest, path)["w.f32"].equal(
        state["w.f32"])
    path.unlink()  # a garbage-collected version: the tensors already handed out stay readable
    assert tensors["w.bf16"].float().sum().isfinite()
    with pytest.raises(WeightsError, match="weights v7: store file .* not found"):
        tensors_from_store(manifest, path)


def test_assemble_rejects_every_kind_of_bad_chunk_naming_the_version():
    payload = serialize(mixed_state())
    manifest = manifest_for(payload, version=7, chunk_size=64)
    good = list(make_chunks(payload.data, 7, 64))
    flipped = WeightsChunk.from_data(version=7, index=1, count=good[1].count, data=flip_byte(good[1].data, 5))
    cases = {
        "payload sha256": good[:1] + [flipped] + good[2:],  # chunk digest fine, payload digest not
        "chunk 1 sha256 mismatch": good[:1] + [dataclasses.replace(good[1], data=flipped.data)] + good[2:],
        "missing 1 of": good[:2] + good[3:],
        "belongs to version 8": good[:1] + [dataclasses.replace(good[1], version=8)] + good[2:],
        "says count": good[:1] + [dataclasses.replace(good[1], count=99)] + good[2:],
        "expected 64": good[:1] + [WeightsChunk.from_data(version=7, index=1, count=good[1].count,
                                                          data=good[1].data[:-1])] + good[2:],
    }
    for needle, chunks in cases.items():
        with pytest.raises(WeightsError, match=needle) as err:
            assemble(manifest, chunks)
        assert str(err.value).startswith("weights v7: ") and err.value.version == 7


def test_decoded_chunks_are_not_hashed_again_when_assembled(monkeypatch):
    """One digest pass per chunk on the fetch side: schemas.decode checks each chunk's SHA-256, so the receiver's
    assembly hashes only the payload; a chunk that did not come through decode is still hashed."""
    import stream_rl.weights.payload as payload_mod
    from schemas import decode, encode

    payload = serialize(mixed_state())
    manifest = manifest_for(payload, version=7, chunk_size=64)
    decoded = [decode(encode(c), "weights_chunk") for c in make_chunks(payload.data, 7, 64)]
    hashed = []
    real = payload_mod.sha256_hex
    monkeypatch.setattr(payload_mod, "sha256_hex", lambda data: hashed.append(len(data)) or real(data))
    assert_same_tensors(tensors_from_chunks(manifest, decoded, digests_checked=True), mixed_state())
    assert hashed == [payload.total_bytes]  # the payload once, no chunk again
    lying = dataclasses.replace(decoded[1], data=flip_byte(decoded[1].data, 0))  # not from decode: its digest lies
    with pytest.raises(WeightsError, match="chunk 1 sha256 mismatch"):
        assemble(manifest, decoded[:1] + [lying] + decoded[2:])


def test_a_chunk_is_hashed_once_when_published_and_once_when_received(monkeypatch):
    import schemas.validation as validation

    calls = []
    real = validation.hashlib.sha256
    monkeypatch.setattr(validation.hashlib, "sha256", lambda data=b"": calls.append(len(data)) or real(data))
    chunk = WeightsChunk.from_data(version=1, index=0, count=1, data=b"payload bytes")
    assert calls == [13]  # from_data hashes the bytes once
    wire = encode(chunk)  # ... and validation trusts that digest of immutable bytes
    assert calls == [13]
    decode(wire, "weights_chunk")  # the receiving side hashes once
    assert calls == [13, 13]
    with pytest.raises(SchemaError, match="sha256: does not match data"):  # a copy is not trusted
        encode(dataclasses.replace(chunk, data=b"other bytes!"))
    assert calls == [13, 13, 12]
    mutable = WeightsChunk.from_data(version=1, index=0, count=1, data=bytearray(b"payload bytes"))
    encode(mutable)  # bytes that could change after hashing are hashed again
    assert calls == [13, 13, 12, 13, 13]


def test_store_file_checks_header_and_data(tmp_path):
    payload = serialize(mixed_state())
    manifest = manifest_for(payload, store_uri="/w/v00000007.safetensors")
    with pytest.raises(WeightsError, match="weights v7: payload sha256"):
        tensors_from_store(manifest, _file(tmp_path, flip_byte(payload.file_bytes, len(payload.file_bytes) - 3)))
    with pytest.raises(WeightsError, match="weights v7: store file: .*tensors cover"):  # cut short
        tensors_from_store(manifest, _file(tmp_path, payload.file_bytes[:-1]))
    other = serialize({**mixed_state(), "w.f32": torch.randn(5, 6)})  # same names, different index
    with pytest.raises(WeightsError, match="weights v7: file index entry"):
        tensors_from_store(manifest, _file(tmp_path, other.file_bytes))
    with pytest.raises(WeightsError, match="weights v7: store file: .*too short"):
        tensors_from_store(manifest, _file(tmp_path, b"\x01"))
    with pytest.raises(WeightsError, match="weights v7: store file: .*header length .* runs past the end"):
        tensors_from_store(manifest, _file(tmp_path, payload.file_bytes[:12]))


def test_decoded_tensors_must_match_the_index(tmp_path):
    payload = serialize({"a": torch.ones(2, 2)})
    manifest = manifest_for(payload, store_uri="/w/v00000007.safetensors")
    lying = dataclasses.replace(manifest, tensors=[dataclasses.replace(manifest.tensors[0], dtype="I32")])
    with pytest.raises(WeightsError, match="weights v7: file index entry .*F32"):  # store: file header vs index
        tensors_from_store(lying, _file(tmp_path, payload.file_bytes))


def test_mode_choice_and_store_uri_parsing(tmp_path):
    auto = WeightsConfig(inline_max_bytes=100)
    assert (choose_mode(auto, 100), choose_mode(auto, 101)) == ("inline", "store")
    assert choose_mode(WeightsConfig(mode="inline", inline_max_bytes=0), 10**9) == "inline"
    assert choose_mode(WeightsConfig(mode="store"), 1) == "store"
    target = tmp_path / "a b" / "v00000001.safetensors"
    assert path_from_uri(1, target.as_uri()) == target
    assert path_from_uri(1, str(target)) == target
    with pytest.raises(WeightsError, match="weights v1: unsupported store_uri"):
        path_from_uri(1, "s3://bucket/v1")


def test_chunk_size_must_fit_the_request_limit():
    cfg = load_config(None, env={}, overrides={"kafka.bootstrap_servers": "127.0.0.1:9", "run_dir": "/nonexistent",
                                               "kafka.max_request_size": 500_000})
    transport = Transport(cfg, "test-weights")  # connects to nothing until a client is made
    with pytest.raises(ValueError, match="exceeds kafka.max_request_size 500000"):
        WeightsPublisher(transport, None, WeightsConfig(), "trainer-0")
    WeightsPublisher(transport, None, WeightsConfig(mode="store"), "trainer-0")  # no chunks in store mode
