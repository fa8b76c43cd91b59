"""Issue 35.1, the trainer's part, through the loop on the in-process bus (``memory://``): a trainer started by hand
on another trainer's run stops with that diagnosis instead of dropping its data as "stale".
(Moved from tests/integration/test_run_reuse.py, same assertions.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.topics import committed
from support.trainer_loop import finish, send_groups, start

from consumers.trainer.trainer import trainer_group
from consumers.trainer.versions import ForeignRunError
from stream_rl.transport.client import Transport

torch.set_num_threads(1)


def test_a_fresh_trainer_on_another_trainers_run_stops_with_the_diagnosis(make_config, model_dir):
    base = {"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 1, "trainer.micro_batch_size": 2,
            "trainer.poll_timeout_s": 0.2, "topics.partitions.scored": 1}
    cfg = make_config(**base, **{"trainer.max_steps": 2})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    send_groups(transport, sink, [0, 1], version=0)
    finish(*start(cfg), timeout_s=90)  # the first trainer: 2 steps, versions 1 and 2 published
    offsets = committed(transport, trainer_group(cfg))

    again = make_config(**base, **{"trainer.max_steps": 4, "run_dir": str(Path(cfg.run_dir).parent / "other")})
    with pytest.raises(ForeignRunError, match=r"weights manifest v2 \(trainer step 2\) on .*weights is ahead of this "
                                              r"trainer's policy version 0: another trainer wrote run"):
        finish(*start(again), timeout_s=60)

    # the rollouts ahead of a trainer: an error naming the record, not a stale drop (a trainer whose weights topic
    # was emptied, e.g. by a partial cleanup, meets rollouts of version 1 at version 0)
    with transport.admin() as admin:
        admin.delete_topics([transport.names.weights])
    transport.ensure_topics()
    send_groups(transport, sink, [2], version=1)
    with pytest.raises(ForeignRunError, match=r"scored rollout .* \(policy version 1\) is ahead of this trainer's "
                                              r"policy version 0"):
        finish(*start(again), timeout_s=60)
    sink.close()
    assert committed(transport, trainer_group(again)) == offsets  # it trained nothing and committed nothing
