"""A LoRA trainer publishing adapter versions a producer applies, through the trainer loop on the in-process bus
(``memory://``). (Moved from tests/integration/test_lora_versions.py, same assertions.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from support.lora import LORA, hf_engine, logits_of  # noqa: E402
from support.trainer import tiny_policy  # noqa: E402

torch.set_num_threads(1)


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
