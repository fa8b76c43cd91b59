"""``trainer.keep_best`` reads the evaluations from the evals topic on the real broker, never from a file.

The evaluator's ledger writes its ``evals.jsonl`` on its own disk (another run dir), and the trainer's run dir holds
a decoy ``evals.jsonl`` whose values say the opposite: a keeper that read either file would keep another version.
A record that is no evaluation sits on the topic between two evaluations: it is skipped with a logged reason."""

from __future__ import annotations

import json
import logging

import torch
from support.waiting import wait_for

from consumers.trainer.config import TrainerConfig
from consumers.trainer.keep_best import KeepBest
from consumers.trainer.ranks import SOLO
from schemas import Evaluation
from stream_rl.config.shared import Agreements
from stream_rl.evaluation.ledger import Ledger, ensure_evals_topic
from stream_rl.storage.checkpoint import read_tensors
from stream_rl.transport.client import Transport

METRIC = "eval/heldout/pass@1"


class Weights:
    """The engine's part in ``KeepBest.hold``: a full state dict (version-stamped) and no LoRA."""

    lora = False

    def __init__(self):
        self.version = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"policy.w": torch.full((2, 2), float(self.version))}


def _evaluation(version: int, value: float) -> Evaluation:
    return Evaluation(version=version, step=version, sets=["heldout"], metrics={"heldout/pass@1": value},
                      evaluator_id="evaluator-1a2b3c4d")


def _judge_all(hook: KeepBest, count: int) -> list:
    judged: list = []
    wait_for(lambda: judged.extend(hook.poll()) or len(judged) >= count, f"{count} judgements", 30.0)
    return judged


def test_keep_best_judges_the_topic_not_a_file(make_config, tmp_path, caplog):
    cfg = make_config()
    transport = Transport(cfg, "test")
    sink = transport.sink()
    topic = ensure_evals_topic(transport)
    tcfg = TrainerConfig(keep_best=METRIC)
    agreements = Agreements(eval_every_versions=2, eval_before_train=True)
    root, engine = tmp_path / "checkpoints", Weights()
    decoy = {0: 0.9, 2: 0.1, 4: 0.95}  # what a keeper reading the trainer's disk would judge by
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    (tmp_path / "run" / "evals.jsonl").write_text("".join(
        json.dumps({"version": v, "step": v, "metrics": {"heldout/pass@1": x}}) + "\n" for v, x in decoy.items()))

    hook = KeepBest.open(tcfg, agreements, transport, root, engine, SOLO)
    for version in (0, 2, 4):
        engine.version = version
        assert hook.hold(version, version) is not None
    ledger = Ledger(sink, topic, tmp_path / "evaluator-disk")  # the evaluator's own disk
    ledger.record(_evaluation(0, 0.25))
    ledger.record(_evaluation(2, 0.75))
    sink.send_raw(topic, b"\x00not an evaluation", key="4")
    sink.flush()
    ledger.record(_evaluation(4, 0.5))
    (tmp_path / "evaluator-disk" / "evals.jsonl").write_text("")  # neither file holds what the topic does

    with caplog.at_level(logging.WARNING, logger="stream_rl.evaluation.feed"):
        judged = _judge_all(hook, 3)
    assert [(j.version, j.outcome, j.value) for j in judged] == [(0, "kept", 0.25), (2, "kept", 0.75),
                                                                 (4, "worse", 0.5)]
    assert hook.keeper.best["version"] == 2 and hook.keeper.best["value"] == 0.75
    assert float(read_tensors(root / "best" / "model.safetensors")["policy.w"][0, 0]) == 2.0
    assert any("skipping evals record" in r.getMessage() and "not an evaluation" in r.getMessage()
               for r in caplog.records)
    hook.close()

    again = KeepBest.open(tcfg, agreements, transport, root, engine, SOLO)  # a restart re-reads the topic
    assert [(j.version, j.outcome) for j in again.poll()] == [(0, "no-weights"), (2, "no-weights"),
                                                              (4, "no-weights")]
    assert again.keeper.best["version"] == 2
    again.close()
    sink.close()
