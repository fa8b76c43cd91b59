"""LoRA versions on the real broker: adapter versions as snapshot then delta, and the bench's byte counts. The merge
math, manifests and the hf engine: tests/unit/test_lora_adapter_versions.py; a LoRA trainer publishing versions a
producer applies: tests/unit/test_trainer_loop_lora.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from support.lora import hf_engine, trained_adapters


torch.set_num_threads(1)


# -- the wire: manifests of adapter versions, and the producer loop's dispatch ---------------------------------


@pytest.mark.broker
def test_adapter_versions_travel_through_the_broker_as_snapshot_then_delta(make_config):
    from stream_rl.transport.client import Transport
    from stream_rl.weights import WeightsConfig
    from stream_rl.weights.publisher import WeightsPublisher
    from stream_rl.weights.receiver import WeightsReceiver

    transport = Transport(make_config(), "test-lora")
    sink = transport.sink()
    cfg = WeightsConfig(mode="inline", chunk_size=4096, snapshot_every=2)
    try:
        _, v1 = trained_adapters(steps=1)
        first = "model.layers.0.self_attn.q_proj.lora_B.weight"
        v2 = {**v1, first: v1[first] + 0.5}  # one tensor changed: a delta is worth sending
        publisher = WeightsPublisher(transport, sink, cfg, "trainer-0")
        sent = [publisher.publish(v, version=i, step=i, adapter=(4, 8.0)) for i, v in ((1, v1), (2, v2))]
        assert [m.is_delta for m in sent] == [False, True] and all(m.adapter_rank == 4 for m in sent)
        producer = hf_engine()
        with WeightsReceiver(transport, cfg) as receiver:
            latest = receiver.poll_latest(timeout_s=10)
            assert (latest.version, latest.adapter_rank, latest.adapter_alpha) == (2, 4, 8.0)
            for manifest in sent:
                fetched = receiver.fetch(manifest)
                producer.load_adapter(fetched, manifest.adapter_alpha / manifest.adapter_rank, manifest.version)
        expected = hf_engine()
        expected.load_adapter(v2, 2.0, version=2)
        assert all(torch.equal(p, q) for p, q in zip(producer.model.parameters(), expected.model.parameters()))
    finally:
        sink.close()


def test_the_bench_counts_adapter_bytes_against_the_full_model():
    from bench.weights import lora_sizes

    figures = lora_sizes()
    # Qwen2.5-0.5B shape, bf16: 24 layers x r 8 x (q 896+896, k 896+128, v 896+128, o 896+896) x 2 bytes
    assert figures["lora.attn.r8.bytes"] == 24 * 8 * (1792 + 1024 + 1024 + 1792) * 2 == 2_162_688
    assert figures["lora.full_bytes"] == 988_065_536  # 494 M parameters (tied embeddings once) x 2 bytes
    assert figures["lora.attn.r8.fraction"] < 0.003
