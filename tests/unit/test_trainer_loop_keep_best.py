"""``trainer.keep_best`` end to end on the in-process bus (``memory://``): the trainer publishes versions, the real
evaluator evaluates some of them, the trainer keeps the best one in ``checkpoints/best/`` (the weights of that very
version), and an evaluation that arrives after the trainer stopped is judged when it starts again (``--resume``).
(Moved from tests/integration/test_keep_best_run.py, same assertions.)"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from support.evaluation import eval_section, write_prompts
from support.trainer_loop import finish, metric_rows, send_groups, start
from support.waiting import wait_for

from consumers.trainer.engines import MODEL_FILE
from producers.engines.hf import HFEngine
from evaluator.role import EvaluatorDeps, EvaluatorStats, run_evaluator
from stream_rl.evaluation.ledger import read_rows
from stream_rl.storage.checkpoint import read_tensors
from stream_rl.transport.client import Transport

torch.set_num_threads(1)
METRIC = "eval/heldout/mean@4"


def _evaluate(cfg, model_dir, count: int) -> list[int]:
    stats = EvaluatorStats()
    run_evaluator(cfg, cfg.eval, cfg.producer, threading.Event(), count,
                  deps=EvaluatorDeps(engine=HFEngine.from_dir(model_dir), stats=stats))
    return stats.evaluated


def _best_expected(rows: list[dict]) -> dict:
    """The row a max-mode keeper must keep: the highest value, the earliest version on a tie."""
    key = METRIC[len("eval/"):]
    return max(rows, key=lambda r: (r["metrics"][key], -r["version"]))


def test_the_trainer_keeps_the_best_evaluated_version_and_judges_late_evaluations_on_restart(
        make_config, model_dir, tmp_path):
    prompts = write_prompts(tmp_path / "heldout.jsonl", count=6)
    cfg = make_config(**{
        "trainer.model_dir": str(model_dir), "producer.model_dir": str(model_dir), "trainer.groups_per_step": 2,
        "trainer.max_steps": 4, "trainer.checkpoint_every": 2, "trainer.keep_checkpoints": 3,
        "trainer.max_lag": 4, "trainer.micro_batch_size": 2, "trainer.poll_timeout_s": 0.2, "trainer.lr": 5e-2,
        "trainer.keep_best": METRIC, "topics.partitions.scored": 1, "run.demo_dir": None,
        "weights.mode": "inline", "weights.chunk_size": 200_000, "eval": eval_section(prompts, every_versions=2)})
    root = Path(cfg.run_dir) / "checkpoints"
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    send_groups(transport, sink, [0, 1, 2, 3], version=0)  # steps 1 and 2: versions 1, 2
    run = start(cfg)
    wait_for(lambda: len(metric_rows(cfg)) >= 2, "steps 1 and 2", 120.0)
    assert _evaluate(cfg, model_dir, 2) == [0, 2]  # v0 (before training), then v2, the newest due
    send_groups(transport, sink, [4, 5, 6, 7], version=2)  # steps 3 and 4: their ends judge the evaluations
    state = finish(*run, timeout_s=120.0)
    assert (state.step, state.version) == (4, 4)

    rows = read_rows(Path(cfg.run_dir) / "evals.jsonl")
    want = _best_expected(rows)
    best = json.loads((root / "best" / "best.json").read_text())
    assert (best["version"], best["step"], best["metric"], best["mode"]) == (want["version"], want["step"], METRIC,
                                                                             "max")
    assert best["value"] == want["metrics"]["heldout/mean@4"]
    # the kept weights are that version's: v0 = the initial policy, v2 = the step-2 checkpoint's
    source = (root / "step-00000002" / MODEL_FILE) if want["version"] == 2 else None
    kept = read_tensors(root / "best" / MODEL_FILE)
    expected = read_tensors(source) if source else _initial(model_dir)
    assert kept.keys() == expected.keys() and all(torch.equal(kept[k], expected[k]) for k in kept)
    assert sorted(p.name for p in (root / "eval-pending").iterdir()) == ["v00000004"]  # not evaluated yet

    assert _evaluate(cfg, model_dir, 1) == [4]  # after the trainer stopped
    rows = read_rows(Path(cfg.run_dir) / "evals.jsonl")
    want = _best_expected(rows)
    (Path(cfg.run_dir) / "evals.jsonl").unlink()  # the trainer judges the evals topic, not the evaluator's file
    finish(*start(cfg, resume=True), timeout_s=120.0)  # max_steps already reached: starts, judges, stops
    best = json.loads((root / "best" / "best.json").read_text())
    assert best["version"] == want["version"] and list((root / "eval-pending").iterdir()) == []
    if want["version"] == 4:
        kept = read_tensors(root / "best" / MODEL_FILE)
        final = read_tensors(root / "step-00000004" / MODEL_FILE)
        assert all(torch.equal(kept[k], final[k]) for k in final)
    sink.close()


def _initial(model_dir: Path) -> dict[str, torch.Tensor]:
    """The engine state of a fresh trainer on ``model_dir``: the policy's fp32 weights under ``policy.``."""
    from consumers.trainer.engines import TrainModule, unique_state
    from stream_rl.models import load_policy

    model, _ = load_policy(model_dir)
    return unique_state(TrainModule(model))
