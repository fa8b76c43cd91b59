"""Delta weight versions: pure XOR + zlib deltas and garbage-collection planning, the manifest's delta fields, then
chains of deltas published and rebuilt on the real local broker (inline and store), bit for bit."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
import torch
from support.weights import assert_same_tensors, chunk_topics, tiny_llama

from schemas import SchemaError, WeightsManifest, decode, encode, validate
from schemas.validation import message_to_wire
from stream_rl.weights import WeightsConfig
from stream_rl.weights.delta import (
    MAX_CHANGED_FRACTION,
    apply_delta,
    changed_fraction,
    doomed_versions,
    encode_delta,
    flat_payload,
    same_layout,
    xor,
)
from stream_rl.weights.payload import WeightsError, serialize
from stream_rl.weights.publisher import WeightsPublisher
from stream_rl.weights.receiver import WeightsReceiver, path_from_uri

torch.set_num_threads(1)


def training_steps(count: int, lr: float = 1e-5, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` bf16 broadcasts of a real tiny Llama whose fp32 master weights take signed-gradient steps of
    size ``lr`` (as Adam's first steps do): most bf16 elements do not move, as in RL fine-tuning."""
    torch.manual_seed(seed)
    master = {k: v.clone() for k, v in tiny_llama().state_dict().items()}
    out = []
    for _ in range(count):
        for tensor in master.values():
            tensor.add_(torch.randn_like(tensor).sign(), alpha=-lr)
        out.append({k: v.to(torch.bfloat16) for k, v in master.items()})
    return out


# ---------------------------------------------------------------- pure: no Kafka


def test_xor_delta_rebuilds_bf16_steps_bit_for_bit_and_is_small():
    first, second = training_steps(2)
    index = serialize(first).tensors
    base, new = flat_payload(first, index), flat_payload(second, index)
    kept = base.copy()
    delta = encode_delta(new, base)
    assert delta is not None and len(delta) < 0.25 * new.size  # most bf16 elements did not change
    rebuilt = apply_delta(2, base, delta)
    assert rebuilt.tobytes() == new.tobytes() and np.array_equal(base, kept)  # exact; the base is not written
    assert 0 < changed_fraction(xor(new, base)) < 0.25
    assert changed_fraction(xor(base, base)) == 0.0 and len(encode_delta(base, base)) < 64


def test_xor_handles_lengths_that_are_not_multiples_of_eight():
    a = np.arange(13, dtype=np.uint8)
    b = np.full(13, 0xFF, dtype=np.uint8)
    assert xor(a, b).tolist() == [x ^ 0xFF for x in range(13)]
    with pytest.raises(ValueError, match="cannot XOR payloads of 13 and 12 bytes"):
        xor(a, b[:12])


def test_a_delta_of_mostly_changed_bytes_is_not_made():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 4096, dtype=np.uint8), rng.integers(0, 256, 4096, dtype=np.uint8)
    assert changed_fraction(xor(a, b)) > MAX_CHANGED_FRACTION
    assert encode_delta(b, a) is None


def test_malformed_deltas_are_rejected_naming_the_problem():
    base = np.zeros(1000, dtype=np.uint8)
    new = base.copy()
    new[::97] = 7  # 11 changed bytes
    delta = encode_delta(new, base)
    head, first = delta[:20], delta[20:20 + int.from_bytes(delta[12:20], "little")]
    rest = delta[20 + len(first):]
    past_end = encode_delta(np.concatenate([new, [0, 0, 9]]).astype(np.uint8), np.zeros(1003, dtype=np.uint8))
    cases = [
        (base[:5], delta, "delta header names 11 changed bytes .*; the payload has 5 bytes"),
        (base, delta[:10], "delta of 10 bytes is shorter than its 20-byte header"),
        (base, b"SRD0" + delta[4:], "delta starts with b'SRD0', not b'SRD1'"),
        (base, head + first + rest[:-3], "delta changed bytes are truncated"),
        (base, delta + b"xy", "delta changed bytes are followed by 2 stray bytes"),
        (base, head + b"junk" * 3 + rest, "delta gap planes do not decompress"),
        (base, head + first + zlib.compress(bytes(10**6)), "delta changed bytes inflate to more than 11 bytes, "
                                                          "the header says 11"),  # a bomb is not inflated
        (base, past_end, "delta names a repeated offset or one past the end of the payload"),
    ]
    for held, blob, message in cases:
        with pytest.raises(WeightsError, match=f"^weights v4: {message}"):
            apply_delta(4, held, blob)
    assert apply_delta(4, base, delta).tobytes() == new.tobytes()
    assert apply_delta(4, base, encode_delta(base, base)).tobytes() == base.tobytes()  # no change at all


def test_flat_payload_requires_the_base_layout():
    state = {"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    index = serialize(state).tensors
    assert same_layout(state, index)
    assert flat_payload(state, index).tobytes() == bytes(serialize(state).data)  # the safetensors data section
    for other, message in (({"a": torch.ones(2, 3)}, "names differ"),
                           ({**state, "b": torch.zeros(4)}, "tensor 'b' is torch.float32 \\(4,\\), the base index "
                                                            "says BF16 \\(4,\\)"),
                           ({**state, "a": torch.ones(3, 2)}, "tensor 'a' is torch.float32 \\(3, 2\\)")):
        assert not same_layout(other, index)
        with pytest.raises(ValueError, match=message):
            flat_payload(other, index)


def test_garbage_collection_keeps_every_version_a_kept_delta_is_rebuilt_from():
    assert doomed_versions({1, 2, 3, 4, 5}, set(), 2) == [1, 2, 3]  # all snapshots: the newest 2 stay
    assert doomed_versions({1, 5}, {2, 3, 4, 6, 7}, 2) == [1, 2, 3, 4]  # 6, 7 need snapshot 5
    assert doomed_versions({1, 5}, {2, 3, 4, 6, 7}, 3) == [1, 2, 3, 4]  # 5 is kept and a snapshot
    assert doomed_versions({1, 5}, {2, 3, 4, 6, 7}, 4) == []  # 4 needs 3, 2 and snapshot 1
    assert doomed_versions({5}, {2, 3, 4, 6}, 3) == []  # 4 is kept, its snapshot is gone: nothing is proven
    assert doomed_versions({1}, {2}, 5) == []
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        doomed_versions({1}, set(), 0)


def _delta_manifest(**changes) -> WeightsManifest:
    fields = dict(version=5, step=5, mode="inline", tensors=list(serialize({"w": torch.ones(100)}).tensors),
                  total_bytes=400, sha256="a" * 64, chunk_size=64, chunk_count=2, chunks_topic="t.weights.v5.delta",
                  trainer_id="trainer-0", delta_base=4, delta_base_sha256="b" * 64, delta_bytes=100,
                  delta_sha256="c" * 64)
    fields.update(changes)
    return WeightsManifest(**fields)


def test_manifest_delta_fields_round_trip_and_are_checked():
    manifest = validate(_delta_manifest())
    back = decode(encode(manifest), "weights_manifest")
    assert (back.delta_base, back.delta_bytes, back.sent_bytes, back.is_delta) == (4, 100, 100, True)
    assert back.chunk_range(1) == (64, 100)  # chunks cut what is sent, not the payload
    old = {k: v for k, v in message_to_wire(dataclasses.replace(manifest, delta_base=None, delta_base_sha256=None,
                                                                delta_bytes=None, delta_sha256=None,
                                                                chunk_count=7)).items()
           if not k.startswith("delta")}
    import msgpack

    full = decode(msgpack.packb(old, use_bin_type=True), "weights_manifest")  # written before deltas existed
    assert (full.is_delta, full.sent_bytes) == (False, 400)
    for change, field, message in (
            ({"delta_sha256": None}, "delta_sha256", "required when delta_base is set"),
            ({"delta_base": None}, "delta_base", "required when delta_base_sha256 is set"),
            ({"delta_base": 5}, "delta_base", "must be below version 5, got 5"),
            ({"chunk_count": 7}, "chunk_count", "must be ceil\\(delta_bytes / chunk_size\\) = 2, got 7")):
        with pytest.raises(SchemaError, match=f"{field}: {message}"):
            validate(_delta_manifest(**change))


# ---------------------------------------------------------------- on the real local broker


@pytest.mark.broker
@pytest.mark.parametrize("mode", ["inline", "store"])
def test_a_chain_of_deltas_rebuilds_every_version_bit_for_bit(bus, tmp_path, mode):
    transport, sink = bus
    cfg = WeightsConfig(mode=mode, chunk_size=16_000, store_dir=tmp_path / "store", snapshot_every=4)
    publisher = WeightsPublisher(transport, sink, cfg, "trainer-0")
    states = dict(enumerate(training_steps(6), start=1))
    manifests = {v: publisher.publish(state, version=v, step=v) for v, state in states.items()}
    assert [m.delta_base for m in manifests.values()] == [None, 1, 2, 3, None, 5]  # a snapshot every 4
    full = manifests[1].total_bytes
    assert all(m.sent_bytes < 0.25 * full for m in manifests.values() if m.is_delta)
    if mode == "store":
        assert path_from_uri(2, manifests[2].store_uri).name == "v00000002.delta"
    else:
        assert manifests[2].chunks_topic == transport.names.weights_chunks(2, delta=True)
    with WeightsReceiver(transport, cfg) as follower:  # follows every version: each delta from the one it holds
        for version, manifest in manifests.items():
            assert_same_tensors(follower.fetch(manifest), states[version])
        assert list(follower.rebuilt_from) == [(2, 1), (3, 2), (4, 3), (6, 5)]
    with WeightsReceiver(transport, cfg) as late:  # joins at v4: snapshot v1 plus three deltas
        assert late.poll_latest(timeout_s=10).version == 6
        assert_same_tensors(late.fetch(manifests[4]), states[4])
        assert_same_tensors(late.fetch(manifests[6]), states[6])
        assert list(late.rebuilt_from) == [(4, 1), (6, 5)]


@pytest.mark.broker
def test_a_missing_or_corrupted_delta_is_rejected_and_the_held_version_kept(bus, tmp_path):
    transport, sink = bus
    cfg = WeightsConfig(mode="inline", chunk_size=16_000, snapshot_every=8, fetch_timeout_s=5)
    publisher = WeightsPublisher(transport, sink, cfg, "trainer-0")
    states = dict(enumerate(training_steps(5), start=1))
    manifests = {v: publisher.publish(s, version=v, step=v) for v, s in states.items()}
    with WeightsReceiver(transport, cfg) as receiver:
        receiver.poll_latest(timeout_s=10)
        assert_same_tensors(receiver.fetch(manifests[2]), states[2])
        admin = transport.admin()
        publisher._delete_topics(admin, [manifests[3].chunks_topic])  # the delta v3 is lost
        admin.close()
        chunk_topics(transport, expect=sorted(manifests[v].chunks_topic for v in (1, 2, 4, 5)))
        with pytest.raises(WeightsError, match=r"^weights v3: chunk topic .*weights\.v3\.delta does not exist"):
            receiver.fetch(manifests[4])  # needs v3 from the held v2, then again from snapshot v1
        assert receiver._held.version == 2  # nothing held changed
        unknown = dataclasses.replace(manifests[5], delta_base_sha256="1" * 64)
        with pytest.raises(WeightsError, match=r"^weights v5: cannot rebuild: the delta chain needs v4 \(sha256 1+\), "
                                               r"whose manifest has another sha256"):
            receiver.fetch(unknown)
    survivor = WeightsPublisher(transport, sink, cfg, "trainer-0")  # a restarted trainer: its first version is full
    fresh = survivor.publish(states[5], version=6, step=6)
    assert not fresh.is_delta
    with WeightsReceiver(transport, cfg) as receiver:
        assert_same_tensors(receiver.fetch(fresh), states[5])


@pytest.mark.broker
def test_a_corrupted_delta_payload_is_rejected_after_the_rebuild(bus, tmp_path):
    transport, sink = bus
    cfg = WeightsConfig(mode="store", store_dir=tmp_path / "store", snapshot_every=4)
    publisher = WeightsPublisher(transport, sink, cfg, "trainer-0")
    states = dict(enumerate(training_steps(2), start=1))
    v1, v2 = (publisher.publish(s, version=v, step=v) for v, s in states.items())
    path = path_from_uri(2, v2.store_uri)
    blob = path.read_bytes()
    with WeightsReceiver(transport, cfg) as receiver:
        receiver.fetch(v1)
        path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
        with pytest.raises(WeightsError, match="^weights v2: delta sha256"):
            receiver.fetch(v2)
        held = np.zeros(v1.total_bytes, dtype=np.uint8)
        forged = encode_delta(held, held)  # a well-formed delta of another version: no change at all
        path.write_bytes(forged)
        relabelled = dataclasses.replace(v2, delta_bytes=len(forged), delta_sha256=_sha(forged))
        with pytest.raises(WeightsError, match="^weights v2: payload sha256 .* does not match"):
            receiver.fetch(relabelled)
        path.write_bytes(blob)
        assert_same_tensors(receiver.fetch(v2), states[2])


@pytest.mark.broker
def test_garbage_collection_never_removes_what_a_kept_delta_needs(bus, tmp_path):
    transport, sink = bus
    cfg = WeightsConfig(mode="auto", inline_max_bytes=60_000, store_dir=tmp_path / "store", snapshot_every=3,
                        keep_last=2)
    publisher = WeightsPublisher(transport, sink, cfg, "trainer-0")
    states = dict(enumerate(training_steps(5), start=1))
    manifests = {v: publisher.publish(s, version=v, step=v) for v, s in states.items()}
    assert [(m.mode, m.delta_base) for m in manifests.values()] == [
        ("store", None), ("inline", 1), ("inline", 2), ("store", None), ("inline", 4)]  # snapshots in the store
    assert publisher.collect_garbage() == [1, 2, 3]  # 4 and 5 kept; 5 is a delta of snapshot 4
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["v00000004.safetensors"]
    assert chunk_topics(transport, expect=[manifests[5].chunks_topic]) == [manifests[5].chunks_topic]
    with WeightsReceiver(transport, cfg) as late:
        late.poll_latest(timeout_s=10)
        assert_same_tensors(late.fetch(manifests[5]), states[5])
    assert publisher.collect_garbage(keep_last=1) == []  # 5 alone still needs 4
    assert publisher.collect_garbage(keep_last=2) == []


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
