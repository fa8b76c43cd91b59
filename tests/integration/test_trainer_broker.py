"""The trainer's one run on the real local broker (kafka-python's clients under the edge): it reads every scored
partition by assignment, trains, publishes a version on the weights topic, checkpoints and commits the same
offsets to its group.

Everything else about the loop (stale drops and re-queues, spans, resume, alert stop and pause) runs on the
in-process bus in tests/unit/test_trainer_loop*.py; tests/integration/test_edge_contract.py proves the bus equal
to the broker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.topics import committed, end_offsets, read_values
from support.trainer_loop import finish, metric_rows, send_groups, start

from consumers.trainer.trainer import trainer_group
from stream_rl.storage.checkpoint import complete_checkpoints, load_checkpoint
from stream_rl.transport.client import Transport

torch.set_num_threads(1)
pytestmark = pytest.mark.broker


def test_the_trainer_trains_publishes_checkpoints_and_commits_on_the_broker(make_config, model_dir):
    cfg = make_config(**{"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 2,
                         "trainer.max_steps": 1, "trainer.checkpoint_every": 1, "trainer.micro_batch_size": 2,
                         "trainer.poll_timeout_s": 0.2, "topics.partitions.scored": 2})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    send_groups(transport, sink, [0, 1], version=0)  # 2 groups of 2, spread over the 2 partitions by group id
    state = finish(*start(cfg))
    sink.close()
    assert (state.step, state.version) == (1, 1)
    assert [(r["step"], r["policy_version"]) for r in metric_rows(cfg)] == [(1, 1)]
    assert [m.version for m in read_values(transport, transport.names.weights, "weights_manifest")] == [1]
    ends = end_offsets(transport, transport.names.scored)
    assert len(ends) == 2 and sum(ends.values()) == 4  # both partitions hold a group
    (checkpoint,) = complete_checkpoints(Path(cfg.run_dir) / "checkpoints")
    assert load_checkpoint(checkpoint).offsets == ends
    assert committed(transport, trainer_group(cfg)) == ends
