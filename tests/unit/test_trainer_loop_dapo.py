"""DAPO's dynamic sampling through the real trainer loop on the in-process bus: uniform groups go to the stale topic,
the others train. The formulas, batcher, targets, step and config rules: tests/unit/test_dapo_options.py.
(Moved from tests/integration/test_dapo.py, same assertions.)"""

from __future__ import annotations

import pytest
import torch
from support.topics import read_values
from support.trainer import scored
from support.trainer_loop import finish, metric_rows, start

from stream_rl.transport.client import Transport

torch.set_num_threads(1)


def test_the_trainer_loop_sends_uniform_groups_to_the_stale_topic_and_trains_the_others(make_config, model_dir):
    cfg = make_config(**{"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 2,
                         "trainer.max_steps": 1, "trainer.dynamic_sampling": True, "trainer.micro_batch_size": 4,
                         "trainer.poll_timeout_s": 0.2, "topics.partitions.scored": 1})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    for prompt, rewards in enumerate([(1.0, 1.0), (1.0, 0.0), (0.0, 0.0), (0.5, 0.0)]):
        for s, r in enumerate(rewards):
            rec = scored(prompt, s, reward=r, response_ids=[6 + s, 7])
            sink.send(transport.names.scored, rec, key=rec.group_id)
    sink.flush()
    state = finish(*start(cfg))
    assert state.step == 1
    row = metric_rows(cfg)[-1]
    assert row["batcher/uniform_total"] == 4.0 and row["batcher/trained_total"] == 4.0
    assert row["reward/mean"] == pytest.approx(0.375)  # p1 (1, 0) and p3 (0.5, 0): only the groups with a gradient
    stale = read_values(transport, transport.names.stale, "stale_rollout")
    assert sorted(s.prompt_id for s in stale) == ["p0", "p0", "p2", "p2"]
    assert all(not s.requeued and "dynamic sampling" in s.reason for s in stale)
    assert read_values(transport, transport.names.prompts, "prompt") == []  # nothing re-queued
