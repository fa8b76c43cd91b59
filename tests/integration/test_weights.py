"""Versioned weight broadcast: pure payload functions without Kafka, then publish/fetch on the real local broker."""

from __future__ import annotations

import dataclasses
import hashlib
import time

import msgpack
import pytest
import torch
from support.weights import _chunk_topics, assert_same_tensors, tiny_llama  # noqa: F401

from schemas import SchemaError, WeightsChunk, decode, encode, validate
from schemas.validation import message_to_wire
from stream_rl.cli.config import load_config
from stream_rl.transport.client import Transport, highwaters, partitions_of
from stream_rl.weights import WeightsConfig
from stream_rl.weights.payload import (
    WeightsError,
    assemble,
    build_manifest,
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
from stream_rl.weights.receiver import WeightsReceiver, path_from_uri

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




def manifest_for(payload, version: int = 7, chunk_size: int = 40, **where):
    where = where or {"chunks_topic": f"stream-rl.x.weights.v{version}"}
    return validate(build_manifest(payload, version=version, step=3, mode="inline" if "chunks_topic" in where
                                   else "store", chunk_size=chunk_size, trainer_id="trainer-0", **where))


# ---------------------------------------------------------------- pure: no Kafka


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


def _file(tmp_path, data: bytes):
    path = tmp_path / "v00000007.safetensors"
    path.write_bytes(data)
    return path


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


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def test_assemble_rejects_every_kind_of_bad_chunk_naming_the_version():
    payload = serialize(mixed_state())
    manifest = manifest_for(payload, version=7, chunk_size=64)
    good = list(make_chunks(payload.data, 7, 64))
    flipped = WeightsChunk.from_data(version=7, index=1, count=good[1].count, data=_flip(good[1].data, 5))
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
    lying = dataclasses.replace(decoded[1], data=_flip(decoded[1].data, 0))  # not from decode: its digest lies
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
        tensors_from_store(manifest, _file(tmp_path, _flip(payload.file_bytes, len(payload.file_bytes) - 3)))
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


# ---------------------------------------------------------------- real broker






@pytest.mark.broker
def test_inline_round_trip_of_a_real_model_fp32_and_bf16(bus):
    transport, sink = bus
    cfg = WeightsConfig(mode="inline", chunk_size=64_000)
    publisher = WeightsPublisher(transport, sink, cfg, "trainer-0")
    states = {1: tiny_llama().state_dict(), 2: tiny_llama(torch.bfloat16).state_dict()}
    manifests = {v: publisher.publish(state, version=v, step=10 * v) for v, state in states.items()}
    assert manifests[1].mode == "inline" and manifests[1].chunk_count > 3
    assert manifests[1].chunks_topic == transport.names.weights_chunks(1)
    reader = transport.reader()
    assert list(highwaters(reader, partitions_of(reader, manifests[1].chunks_topic)).values()) == \
        [manifests[1].chunk_count]
    reader.close()
    with WeightsReceiver(transport, cfg) as receiver:
        latest = receiver.poll_latest(timeout_s=10)
        assert latest is not None and (latest.version, latest.step) == (2, 20)
        for version, state in states.items():
            fetched = receiver.fetch(manifests[version])
            assert_same_tensors(fetched, state)
    assert {t.dtype for t in fetched.values()} == {torch.bfloat16}
    model = tiny_llama()
    model.load_state_dict({k: v.float() for k, v in fetched.items()}, strict=True)


@pytest.mark.broker
def test_store_round_trip_writes_the_file_before_the_manifest(bus):
    transport, sink = bus
    cfg = WeightsConfig(mode="store")
    state = tiny_llama().state_dict()
    manifest = WeightsPublisher(transport, sink, cfg, "trainer-0").publish(state, version=4, step=9)
    path = transport.cfg.run_dir / "weights" / "v00000004.safetensors"
    assert manifest.mode == "store" and manifest.chunks_topic is None
    assert path_from_uri(4, manifest.store_uri) == path.resolve() and path.is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    assert _chunk_topics(transport) == []
    admin = transport.admin()
    assert [len(d["partitions"]) for d in admin.describe_topics([transport.names.weights])] == [1]  # not auto-made
    admin.close()
    with WeightsReceiver(transport, cfg) as receiver:
        latest = receiver.poll_latest(timeout_s=10)
        assert latest is not None and latest.sha256 == manifest.sha256
        assert_same_tensors(receiver.fetch(latest), state)


@pytest.mark.broker
def test_auto_mode_switches_to_the_store_above_inline_max_bytes(bus, tmp_path):
    transport, sink = bus
    cfg = WeightsConfig(mode="auto", inline_max_bytes=1000, store_dir=tmp_path / "store")
    publisher = WeightsPublisher(transport, sink, cfg, "trainer-0")
    small = publisher.publish({"w": torch.ones(250)}, version=1, step=1)  # 1000 bytes: not above the limit
    big = publisher.publish({"w": torch.ones(251)}, version=2, step=2)
    assert (small.mode, big.mode) == ("inline", "store")
    assert path_from_uri(2, big.store_uri) == (tmp_path / "store" / "v00000002.safetensors").resolve()
    with WeightsReceiver(transport, cfg) as receiver:
        assert torch.equal(receiver.fetch(small)["w"], torch.ones(250))
        assert torch.equal(receiver.fetch(big)["w"], torch.ones(251))


def _send_version(transport, sink, payload, version: int, chunks) -> object:
    """Publish by hand (for tampering): chunk topic, the given chunk records or raw values, acks, manifest."""
    topic = transport.names.weights_chunks(version)
    manifest = manifest_for(payload, version=version, chunk_size=1000, chunks_topic=topic)
    transport.ensure_topics(extra={topic: 1})
    for chunk in chunks(manifest):
        if isinstance(chunk, bytes):
            sink.send_raw(topic, chunk, key=str(version))
        else:
            sink.send(topic, chunk, key=str(version))
    sink.flush()
    sink.send(transport.names.weights, manifest, key=str(version))
    sink.flush()
    return manifest


@pytest.mark.broker
def test_corrupted_chunks_are_rejected_naming_the_version(bus):
    transport, sink = bus
    payload = serialize({"w": torch.randn(1000)})  # 4000 bytes: 4 chunks of 1000

    def flipped(manifest):  # chunk 2's own digest matches its (corrupted) bytes; the payload digest does not
        good = list(make_chunks(payload.data, manifest.version, 1000))
        good[2] = WeightsChunk.from_data(version=manifest.version, index=2, count=4, data=_flip(good[2].data, 9))
        return good

    def bad_digest(manifest):  # chunk 1 arrives with a digest of other bytes (sent raw: encode would refuse it)
        good = list(make_chunks(payload.data, manifest.version, 1000))
        wrong = dataclasses.replace(good[1], sha256=sha256_hex(b"other"))
        return good[:1] + [msgpack.packb(message_to_wire(wrong), use_bin_type=True)] + good[2:]

    m3 = _send_version(transport, sink, payload, 3, flipped)
    m5 = _send_version(transport, sink, payload, 5, bad_digest)
    with WeightsReceiver(transport, WeightsConfig(fetch_timeout_s=20)) as receiver:
        with pytest.raises(WeightsError, match=r"^weights v3: payload sha256"):
            receiver.fetch(m3)
        with pytest.raises(WeightsError, match=r"^weights v5: chunk record .*@1 rejected: .*sha256"):
            receiver.fetch(m5)


@pytest.mark.broker
def test_missing_chunk_or_topic_fails_within_fetch_timeout(bus):
    transport, sink = bus
    payload = serialize({"w": torch.randn(750)})  # 3000 bytes: 3 chunks
    manifest = _send_version(transport, sink, payload, 6,
                             lambda m: [c for c in make_chunks(payload.data, 6, 1000) if c.index != 1])
    gone = dataclasses.replace(manifest, version=9, chunks_topic=transport.names.weights_chunks(9))
    with WeightsReceiver(transport, WeightsConfig(fetch_timeout_s=3)) as receiver:
        for bad, needle in ((manifest, r"^weights v6: missing 1 of 3 chunks: 1$"), (gone, r"^weights v9: chunk topic")):
            started = time.monotonic()
            with pytest.raises(WeightsError, match=needle):
                receiver.fetch(bad)
            assert time.monotonic() - started < 3 + 5  # fetch_timeout_s plus client start-up, not forever


@pytest.mark.broker
def test_late_joiner_starts_from_the_newest_version(bus):
    transport, sink = bus
    cfg = WeightsConfig(mode="inline", chunk_size=5000)
    publisher = WeightsPublisher(transport, sink, cfg, "trainer-0")
    early = WeightsReceiver(transport, cfg)
    assert early.poll_latest(timeout_s=0.0) is None
    states = {v: {"w": torch.full((3000,), float(v)), "b": torch.tensor([v])} for v in (1, 2, 3)}
    for version, state in states.items():
        publisher.publish(state, version=version, step=version)
    with WeightsReceiver(transport, cfg) as late:
        latest = late.poll_latest(timeout_s=10)
        assert latest is not None and latest.version == 3
        assert_same_tensors(late.fetch(latest), states[3])
        started = time.monotonic()
        assert late.poll_latest(timeout_s=0.5, newer_than=3).version == 3  # waits for v4, which never comes
        assert time.monotonic() - started >= 0.5
    assert early.poll_latest(timeout_s=10, newer_than=2).version == 3
    early.close()


@pytest.mark.broker
def test_garbage_collection_keeps_the_newest_versions_across_modes(bus, tmp_path):
    transport, sink = bus
    cfg = WeightsConfig(mode="auto", inline_max_bytes=100, store_dir=tmp_path / "store", keep_last=2)
    publisher = WeightsPublisher(transport, sink, cfg, "trainer-0")
    sizes = {1: 10, 2: 50, 3: 10, 4: 50, 5: 10}  # 40-byte payloads go inline, 200-byte ones to the store
    manifests = {v: publisher.publish({"w": torch.full((n,), float(v))}, version=v, step=v)
                 for v, n in sizes.items()}
    assert [m.mode for m in manifests.values()] == ["inline", "store", "inline", "store", "inline"]
    (tmp_path / "store" / ".v00000002.safetensors.0123abcd.tmp").write_bytes(b"left by a crashed write")
    names = transport.names
    assert _chunk_topics(transport) == [names.weights_chunks(v) for v in (1, 3, 5)]

    assert publisher.collect_garbage() == [1, 2, 3]
    assert _chunk_topics(transport, expect=[names.weights_chunks(5)]) == [names.weights_chunks(5)]
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["v00000004.safetensors"]
    assert publisher.collect_garbage() == []  # nothing more to remove, no error
    admin = transport.admin()
    publisher._delete_topics(admin, [names.weights_chunks(1)])  # already deleted: tolerated
    admin.close()
    assert publisher.collect_garbage(keep_last=1) == [4]
    assert list((tmp_path / "store").iterdir()) == []
    with WeightsReceiver(transport, WeightsConfig(fetch_timeout_s=3)) as receiver:
        with pytest.raises(WeightsError, match="^weights v3: chunk topic .* does not exist"):
            receiver.fetch(manifests[3])
        with pytest.raises(WeightsError, match="^weights v4: store file .* not found"):
            receiver.fetch(manifests[4])
        assert torch.equal(receiver.fetch(manifests[5])["w"], torch.full((10,), 5.0))
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        publisher.collect_garbage(keep_last=0)


def test_chunk_size_must_fit_the_request_limit():
    cfg = load_config(None, env={}, overrides={"kafka.bootstrap_servers": "127.0.0.1:9", "run_dir": "/nonexistent",
                                               "kafka.max_request_size": 500_000})
    transport = Transport(cfg, "test-weights")  # connects to nothing until a client is made
    with pytest.raises(ValueError, match="exceeds kafka.max_request_size 500000"):
        WeightsPublisher(transport, None, WeightsConfig(), "trainer-0")
    WeightsPublisher(transport, None, WeightsConfig(mode="store"), "trainer-0")  # no chunks in store mode
