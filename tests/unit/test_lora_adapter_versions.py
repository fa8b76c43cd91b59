"""LoRA adapter versions without a broker: the merged weight by hand, wire names and pair refusals, repeated
versions that never accumulate, the producer applying an adapter version with its scale."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.lora import hf_engine, logits_of, trained_adapters
from support.trainer import tiny_policy

from producers.engines.base import WeightsMismatch  # noqa: E402
from stream_rl.models.lora import adapter_pairs, lora_scale, merged_weight, wire_name  # noqa: E402

pytest.importorskip("peft")

torch.set_num_threads(1)


def test_merged_weight_by_hand():
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # W0 [out 2, in 2]
    a = torch.tensor([[1.0, -1.0]])  # A [r 1, in 2]
    b = torch.tensor([[2.0], [0.5]])  # B [out 2, r 1]; B A = [[2, -2], [0.5, -0.5]]
    assert lora_scale(1, 3.0) == 3.0
    expected = torch.tensor([[7.0, -4.0], [4.5, 2.5]])  # W0 + 3 * B A
    assert torch.equal(merged_weight(base, a, b, 3.0), expected)
    assert merged_weight(base.bfloat16(), a, b, 3.0).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="do not fit"):
        merged_weight(base, a.T, b, 1.0)


def test_wire_names_and_pair_refusals():
    assert wire_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(ValueError, match="not a LoRA adapter parameter"):
        wire_name("base_model.model.model.embed_tokens.weight")
    a, b = torch.zeros(2, 4), torch.zeros(3, 2)
    assert adapter_pairs({"m.lora_A.weight": a, "m.lora_B.weight": b})["m"].rank == 2
    with pytest.raises(ValueError, match=r"m\.lora_B\.weight is missing"):
        adapter_pairs({"m.lora_A.weight": a})
    with pytest.raises(ValueError, match="disagree on the rank"):
        adapter_pairs({"m.lora_A.weight": a, "m.lora_B.weight": torch.zeros(3, 5)})
    with pytest.raises(ValueError, match="is not an adapter tensor"):
        adapter_pairs({"m.weight": a})


def test_repeated_adapter_versions_never_accumulate_and_a_bad_one_changes_nothing():
    _, v1 = trained_adapters(steps=1)
    _, v2 = trained_adapters(steps=2)
    twice, once = hf_engine(), hf_engine()
    twice.load_adapter(v1, 2.0, version=1)
    twice.load_adapter(v2, 2.0, version=2)
    once.load_adapter(v2, 2.0, version=2)
    for (name, p), q in zip(twice.model.named_parameters(), once.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    fewer = {k: t for k, t in v1.items() if ".mlp.up_proj." not in k}  # up_proj leaves the adapter: back to W0
    twice.load_adapter(fewer, 2.0, version=3)
    base = dict(tiny_policy(seed=0).named_parameters())
    assert torch.equal(dict(twice.model.named_parameters())["model.layers.0.mlp.up_proj.weight"],
                       base["model.layers.0.mlp.up_proj.weight"])
    before = {n: p.clone() for n, p in twice.model.named_parameters()}
    bad = {**v2, "model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(3, 64)}  # no B for it
    with pytest.raises(WeightsMismatch):
        twice.load_adapter(bad, 2.0, version=4)
    with pytest.raises(WeightsMismatch, match="the model has no weight"):
        twice.load_adapter({"nope.lora_A.weight": torch.zeros(4, 64), "nope.lora_B.weight": torch.zeros(64, 4)},
                           2.0, version=4)
    assert twice.version == 3 and all(torch.equal(p, before[n]) for n, p in twice.model.named_parameters())


def test_a_published_adapter_version_gives_the_producer_the_trainers_logits():
    from consumers.trainer.engines import cast_floating
    from schemas import decode, encode
    from stream_rl.weights.payload import (
        build_manifest,
        make_chunks,
        serialize,
        tensors_from_chunks,
    )

    trainer, _ = trained_adapters(steps=2)
    payload = serialize(cast_floating(trainer.policy_state_dict(), "float32"))
    manifest = build_manifest(payload, version=2, step=2, mode="inline", chunk_size=4096,
                              trainer_id="trainer-0", chunks_topic="stream-rl.t.weights.v2")
    manifest = decode(encode(dataclasses.replace(manifest, adapter_rank=4, adapter_alpha=8.0)))
    # fp32 bytes: 2 layers x rank 4 x (q: 64 + 64, v: 64 + 64, up: 64 + 128) = 14336; the full model: 337152
    assert manifest.is_adapter and manifest.total_bytes == 4 * 2 * 4 * (128 + 128 + 192) == 14336
    assert sum(p.numel() * 4 for p in tiny_policy().parameters()) == 337_152
    tensors = tensors_from_chunks(manifest, make_chunks(memoryview(payload.data), 2, manifest.chunk_size))
    producer = hf_engine()
    producer.load_adapter(tensors, manifest.adapter_alpha / manifest.adapter_rank, manifest.version)
    ids = torch.tensor([[3, 9, 4, 10, 5, 6], [8, 8, 2, 11, 11, 7]])
    expected = logits_of(trainer.module.policy, ids)
    assert not torch.allclose(expected, logits_of(tiny_policy(seed=0), ids), atol=1e-4)  # the adapters matter
    torch.testing.assert_close(logits_of(producer.model, ids), expected, rtol=1e-5, atol=1e-5)
    assert producer.version == 2


def adapter_manifest(tensors: dict[str, torch.Tensor], version: int = 1, **fields):
    from stream_rl.weights.payload import build_manifest, serialize

    manifest = build_manifest(serialize(tensors), version=version, step=version, mode="store", chunk_size=4096,
                              trainer_id="trainer-0", store_uri="file:///tmp/x")
    return dataclasses.replace(manifest, **fields)


def test_adapter_fields_round_trip_and_come_as_a_pair():
    from schemas import SchemaError, decode, encode

    tensors = {"m.lora_A.weight": torch.zeros(2, 4), "m.lora_B.weight": torch.zeros(3, 2)}
    manifest = adapter_manifest(tensors, adapter_rank=2, adapter_alpha=4.0)
    assert decode(encode(manifest)) == manifest and manifest.is_adapter
    full = adapter_manifest(tensors)
    assert not decode(encode(full)).is_adapter  # a full version: both nil
    with pytest.raises(SchemaError, match="adapter_alpha"):
        encode(dataclasses.replace(manifest, adapter_alpha=None))
    with pytest.raises(SchemaError, match="adapter_rank"):
        encode(dataclasses.replace(manifest, adapter_rank=None))


def test_the_producer_loop_applies_an_adapter_version_with_its_scale():
    from producers.weights_follower import ProducerStats, WeightsFollower

    _, tensors = trained_adapters(steps=1)
    manifest = adapter_manifest(tensors, version=5, adapter_rank=4, adapter_alpha=8.0)

    class Receiver:
        def fetch(self, m):
            assert m.version == 5
            return tensors

    engine, expected = hf_engine(), hf_engine()
    expected.load_adapter(tensors, 2.0, version=5)
    stats = ProducerStats()
    assert WeightsFollower(Receiver(), engine, stats).load(manifest)
    assert engine.version == 5 and stats.weight_updates == [5]
    assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), expected.model.parameters()))
    as_full = dataclasses.replace(manifest, adapter_rank=None, adapter_alpha=None)  # adapters as full weights
    assert not WeightsFollower(Receiver(), hf_engine(), stats).load(as_full)  # refused, nothing loaded
