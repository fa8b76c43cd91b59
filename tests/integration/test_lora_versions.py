"""LoRA versions on the real broker: adapter versions as snapshot then delta, a LoRA trainer publishing versions a
producer applies, and the bench's byte counts. The merge math, manifests and the hf engine:
tests/unit/test_lora_adapter_versions.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from support.lora import LORA, hf_engine, logits_of, trained_adapters
from support.trainer import tiny_policy


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


@pytest.mark.broker
def test_a_lora_trainer_publishes_adapter_versions_a_producer_applies(make_config, tmp_path):
    from support.trainer_loop import finish, metric_rows, send_groups, start
    from support.waiting import wait_for

    from consumers.trainer.export import export_checkpoint
    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models import save_model
    from stream_rl.transport.client import Transport
    from stream_rl.weights.receiver import WeightsReceiver

    model_dir = save_model(tiny_policy(seed=0), build_tokenizer(), tmp_path / "policy")
    cfg = make_config(**{"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 2,
                         "trainer.max_steps": 2, "trainer.checkpoint_every": 1, "trainer.max_lag": 4,
                         "trainer.micro_batch_size": 2, "trainer.poll_timeout_s": 0.2, "trainer.lr": 1e-2,
                         "trainer.lora": LORA, "topics.partitions.scored": 1})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    send_groups(transport, sink, [0, 1], version=0)
    run = start(cfg)
    wait_for(lambda: len(metric_rows(cfg)) >= 1, "step 1")
    send_groups(transport, sink, [2, 3], version=1)
    assert (finish(*run).step, len(metric_rows(cfg))) == (2, 2)
    assert all(r["weights/sent_bytes"] == 14336 for r in metric_rows(cfg))  # the adapters, fp32, not the model
    producer = hf_engine()
    with WeightsReceiver(transport, cfg.weights) as receiver:
        latest = receiver.poll_latest(timeout_s=10)
        assert (latest.version, latest.adapter_rank, latest.adapter_alpha) == (2, 4, 8.0)
        producer.load_adapter(receiver.fetch(latest), latest.adapter_alpha / latest.adapter_rank, latest.version)
    sink.close()
    merged = export_checkpoint(Path(cfg.run_dir) / "checkpoints" / "step-00000002", model_dir, tmp_path / "out")
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[3, 9, 4, 10, 5, 6]])
    expected = logits_of(AutoModelForCausalLM.from_pretrained(merged).eval(), ids)
    assert not torch.allclose(expected, logits_of(tiny_policy(seed=0), ids), atol=1e-4)
    torch.testing.assert_close(logits_of(producer.model, ids), expected, rtol=1e-5, atol=1e-5)
