"""Versioned weight broadcast on the real local broker: inline and store round trips, mode switching, corrupt or
missing chunks, late joiners and garbage collection. The pure payload functions: tests/unit/test_weights_payload.py."""

from __future__ import annotations

import dataclasses
import time

import msgpack
import pytest
import torch
from support.weights import assert_same_tensors, chunk_topics, flip_byte, manifest_for, tiny_llama

from schemas import WeightsChunk
from schemas.validation import message_to_wire
from stream_rl.weights import WeightsConfig
from stream_rl.weights.payload import (
    WeightsError,
    make_chunks,
    serialize,
    sha256_hex,
)
from stream_rl.weights.publisher import WeightsPublisher
from stream_rl.weights.receiver import WeightsReceiver, path_from_uri

torch.set_num_threads(1)


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
    with transport.reader() as reader:
        assert list(reader.highwaters(reader.partitions(manifests[1].chunks_topic)).values()) == \
            [manifests[1].chunk_count]
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
    assert chunk_topics(transport) == []
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
        good[2] = WeightsChunk.from_data(version=manifest.version, index=2, count=4, data=flip_byte(good[2].data, 9))
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
    assert chunk_topics(transport) == [names.weights_chunks(v) for v in (1, 3, 5)]

    assert publisher.collect_garbage() == [1, 2, 3]
    assert chunk_topics(transport, expect=[names.weights_chunks(5)]) == [names.weights_chunks(5)]
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
