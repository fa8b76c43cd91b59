"""The trainer's experiment trackers take the evaluations from the evals topic, on the in-process bus
(``memory://``), as on a cluster: the evaluator's ledger writes its ``evals.jsonl`` in the evaluator's own run dir,
and the trainer's run dir has none. A trainer that followed ``run_dir/evals.jsonl`` would log no evaluation; the
TensorBoard files are read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import torch
from support.trackers import READERS
from support.trainer_loop import finish, metric_rows, send_groups, start
from support.waiting import wait_for

from schemas import Evaluation
from stream_rl.evaluation.ledger import Ledger, ensure_evals_topic
from stream_rl.transport.client import Transport

torch.set_num_threads(1)


def evaluation(version: int, accuracy: float) -> Evaluation:
    return Evaluation(version=version, step=version, sets=["heldout"], metrics={"heldout/accuracy": accuracy},
                      evaluator_id="evaluator-test")


def test_the_trainer_logs_the_topic_evaluations_without_the_evaluators_file(make_config, model_dir, tmp_path):
    cfg = make_config(**{"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 2, "trainer.max_steps": 3,
                         "trainer.max_lag": 4, "trainer.micro_batch_size": 2, "trainer.poll_timeout_s": 0.2,
                         "topics.partitions.scored": 1, "telemetry.trackers": ["tensorboard"]})
    evaluator_cfg = make_config(**{"run_dir": str(tmp_path / "evaluator-run"),  # the same bus, another disk
                                    "topics.partitions.scored": 1})
    evaluator = Transport(evaluator_cfg, "evaluator")
    ledger = Ledger(evaluator.sink(), ensure_evals_topic(evaluator), Path(evaluator_cfg.run_dir))
    ledger.record(evaluation(0, 0.25))  # before the trainer starts: the topic's backlog
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    send_groups(transport, sink, [0, 1], version=0)
    run = start(cfg)
    wait_for(lambda: len(metric_rows(cfg)) >= 1, "step 1")
    ledger.record(evaluation(1, 0.75))  # while the trainer runs
    send_groups(transport, sink, [2, 3, 4, 5], version=1)
    state = finish(*run)
    assert state.step == 3
    sink.close()
    ledger.sink.close()

    assert (Path(evaluator_cfg.run_dir) / "evals.jsonl").is_file()
    assert not (Path(cfg.run_dir) / "evals.jsonl").exists()  # nothing to read on the trainer's disk
    got = READERS["tensorboard"](Path(cfg.run_dir) / "trackers")
    assert got["eval/heldout/accuracy"] == {0: [0.25], 1: [0.75]}  # at the evaluated version's step, once each
    assert sorted(got["reward/mean"]) == [1, 2, 3]
