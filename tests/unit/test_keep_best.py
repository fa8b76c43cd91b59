"""``trainer.keep_best``: the best evaluated version kept beside the latest checkpoint (stream_rl/evaluation/best.py,
consumers/trainer/keep_best.py): judging, candidates, crash recovery, gc, export, and the config rule. The
evaluations come as records of an evals topic (a list per test here) through the feed's pure step
(stream_rl/evaluation/feed.py), which also gets its own test: bad and foreign records are skipped."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import pytest
import torch
from support.trainer import tiny_policy, trainer_cfg

from consumers.trainer.engines import MODEL_FILE, TorchEngine, TrainModule
from consumers.trainer.keep_best import KeepBest
from consumers.trainer.ranks import SOLO
from schemas import Evaluation, encode
from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError
from stream_rl.evaluation.best import (
    BEST_FILE,
    BestKeeper,
    improves,
    is_due,
    keep_best_problem,
    metric_key,
    set_metric_names,
)
from stream_rl.evaluation.feed import evaluation_rows
from stream_rl.operator_tools.gc import GcPaths, GcPolicy, apply_gc, plan_gc
from stream_rl.storage.checkpoint import read_tensors, save_checkpoint, write_tensors
from stream_rl.transport.reader import Record

torch.set_num_threads(1)
METRIC = "eval/heldout/greedy/accuracy"


def weights_of(version: int) -> dict[str, torch.Tensor]:
    return {"policy.w": torch.full((2, 3), float(version))}


def writer(version: int):
    return lambda d: write_tensors(d / MODEL_FILE, weights_of(version))


TOPICS: dict = defaultdict(list)  # the evals topic of each test (by tmp_path): its record values, in order


class ListFeed:
    """A feed over a test's topic, from its first record, through the real pure step."""

    def __init__(self, tmp_path):
        self.records, self.offset, self.seen = TOPICS[tmp_path], 0, set()

    def new_rows(self) -> list[dict]:
        new = self.records[self.offset:]
        recs = [Record("evals", 0, self.offset + i, None, value) for i, value in enumerate(new)]
        self.offset += len(new)
        return evaluation_rows(recs, self.seen).rows


def keeper(tmp_path, mode="max", every=2, before=True, limit=3) -> BestKeeper:
    return BestKeeper(tmp_path / "checkpoints", ListFeed(tmp_path), METRIC, mode, every, before, limit)


def evaluation(version: int, value: float | None, step: int | None = None) -> Evaluation:
    metrics = {} if value is None else {"heldout/greedy/accuracy": value, "heldout/pass@1": 1.0 - value}
    return Evaluation(version=version, step=version if step is None else step, sets=["heldout"], metrics=metrics,
                      evaluator_id="evaluator-test")


def append_row(tmp_path, version: int, value: float | None, step: int | None = None, bad: bool = False) -> None:
    """Publish the evaluation of ``version`` on the test's topic (``bad``: bytes that are no message)."""
    TOPICS[tmp_path].append(b"\x00not msgpack" if bad else encode(evaluation(version, value, step)))


def kept_version(k: BestKeeper) -> float:
    return float(read_tensors(k.best_dir / MODEL_FILE)["policy.w"][0, 0])


def test_improves_max_min_and_ties_keep_the_earlier():
    assert improves(0.5, None, "max") and improves(0.5, None, "min")
    assert improves(0.6, 0.5, "max") and not improves(0.5, 0.5, "max") and not improves(0.4, 0.5, "max")
    assert improves(0.4, 0.5, "min") and not improves(0.5, 0.5, "min") and not improves(0.6, 0.5, "min")
    with pytest.raises(ValueError, match="keep_best_mode"):
        improves(1.0, 0.0, "best")


def test_due_versions_follow_the_evaluator_schedule():
    assert [v for v in range(9) if is_due(v, 4, True)] == [0, 4, 8]
    assert [v for v in range(9) if is_due(v, 4, False)] == [4, 8]
    assert metric_key(METRIC) == "heldout/greedy/accuracy"
    with pytest.raises(ValueError, match="eval/<set>/<metric>"):
        metric_key("heldout/greedy/accuracy")


def test_metric_names_and_problems():
    names = set_metric_names(4, [1, 2], greedy=True, extractor=False)
    assert {"mean@4", "pass@1", "pass@2", "greedy/accuracy", "length/mean", "finish/stop"} <= names
    assert "maj@1" not in names and "maj@2" in set_metric_names(4, [2], greedy=False, extractor=True)
    assert "greedy/accuracy" not in set_metric_names(4, [1], greedy=False, extractor=False)
    assert keep_best_problem(METRIC, ["heldout"], names) is None
    assert keep_best_problem("eval/heldout/gsm8k/pass@2", ["heldout"], names) is None  # per data source
    assert "'train' is not an eval set" in keep_best_problem("eval/train/pass@1", ["heldout"], names)
    assert "no evaluation produces metric 'pass@8'" in keep_best_problem("eval/heldout/pass@8", ["heldout"], names)


def test_the_best_version_is_kept_and_worse_or_skipped_candidates_are_deleted(tmp_path):
    k = keeper(tmp_path, limit=4)
    assert k.hold(0, 0, writer(0)) is not None
    assert k.hold(1, 1, writer(1)) is None  # not due (every 2)
    for v in (2, 4, 6):
        k.hold(v, v, writer(v))
    assert sorted(k.pending()) == [0, 2, 4, 6]
    append_row(tmp_path, 0, 0.25)
    append_row(tmp_path, 4, 0.125)  # v2 skipped by the evaluator
    outcomes = [(j.version, j.outcome, j.value) for j in k.poll()]
    assert outcomes == [(0, "kept", 0.25), (4, "worse", 0.125)]
    assert sorted(k.pending()) == [6] and kept_version(k) == 0.0
    append_row(tmp_path, 6, 0.75, step=12)
    assert [(j.version, j.outcome) for j in k.poll()] == [(6, "kept")]
    best = json.loads((k.best_dir / BEST_FILE).read_text())
    assert (best["metric"], best["mode"], best["value"], best["version"], best["step"]) == (METRIC, "max", 0.75, 6, 12)
    assert kept_version(k) == 6.0 and k.pending() == {}
    assert not list(k.root.glob(".best-old-*"))


def test_min_mode_keeps_the_lowest(tmp_path):
    k = keeper(tmp_path, mode="min", before=False)
    for v in (2, 4):
        k.hold(v, v, writer(v))
    append_row(tmp_path, 2, 0.5)
    append_row(tmp_path, 4, 0.25)
    assert [j.outcome for j in k.poll()] == ["kept", "kept"]
    assert kept_version(k) == 4.0 and k.best["value"] == 0.25


def test_a_bad_record_is_skipped_and_a_row_without_the_metric_keeps_nothing(tmp_path):
    k = keeper(tmp_path, before=False)
    k.hold(2, 2, writer(2))
    k.hold(4, 4, writer(4))
    append_row(tmp_path, 2, None)
    append_row(tmp_path, 4, 0.5, bad=True)
    assert [(j.version, j.outcome) for j in k.poll()] == [(2, "no-metric")]
    append_row(tmp_path, 4, 0.5)
    assert [(j.version, j.outcome) for j in k.poll()] == [(4, "kept")]


def test_pending_limit_drops_the_oldest_and_its_late_row_keeps_nothing(tmp_path):
    k = keeper(tmp_path, before=False, limit=2)
    for v in (2, 4, 6, 8):
        k.hold(v, v, writer(v))
    assert sorted(k.pending()) == [6, 8]
    append_row(tmp_path, 2, 0.9)
    assert [(j.version, j.outcome) for j in k.poll()] == [(2, "no-weights")]
    assert k.best is None


def test_a_restart_rereads_the_rows_without_changing_the_best(tmp_path):
    k = keeper(tmp_path)
    k.hold(0, 0, writer(0))
    k.hold(2, 2, writer(2))
    append_row(tmp_path, 0, 0.5)
    append_row(tmp_path, 2, 0.25)
    k.poll()
    again = keeper(tmp_path)
    assert again.hold(2, 2, writer(99)) is not None  # re-held after a resume: a fresh candidate
    judged = again.poll()  # the backlog: v0 and v2 were judged before
    assert [(j.version, j.outcome) for j in judged] == [(0, "no-weights"), (2, "worse")]
    assert kept_version(again) == 0.0 and again.best["version"] == 0


def test_a_crash_between_the_renames_puts_the_old_best_back(tmp_path):
    k = keeper(tmp_path, before=False)
    k.hold(2, 2, writer(2))
    append_row(tmp_path, 2, 0.5)
    k.poll()
    os.rename(k.best_dir, k.root / ".best-old-deadbeef")  # the promotion's first rename, then a crash
    k2 = keeper(tmp_path, before=False)
    assert k2.best["version"] == 2 and kept_version(k2) == 2.0
    assert not list(k2.root.glob(".best-old-*"))


def test_gc_and_pruning_never_remove_best_or_pending(tmp_path):
    k = keeper(tmp_path, before=False)
    for v in (2, 4):
        k.hold(v, v, writer(v))
    append_row(tmp_path, 2, 0.5)
    k.poll()
    engine = TorchEngine(TrainModule(tiny_policy(seed=0)), trainer_cfg())
    for step in (1, 2, 3):
        save_checkpoint(k.root, step=step, version=step, engine=engine, offsets={}, ledger={}, state={})
    old = time.time() - 10 * 86_400
    for path in [k.best_dir, *k.pending().values(), *k.root.iterdir()]:
        os.utime(path, (old, old))
    paths = GcPaths(k.root, tmp_path / "weights", tmp_path / "logs", tmp_path / "spans.jsonl", tmp_path / "tel")
    actions = plan_gc(paths, GcPolicy(keep_checkpoints=1, keep_weights=1, older_than_s=0.0), time.time())
    assert sorted(a.path.name for a in actions) == ["step-00000001", "step-00000002"]
    apply_gc(actions)
    assert sorted(p.name for p in k.root.iterdir()) == ["best", "eval-pending", "step-00000003"]
    assert kept_version(k) == 2.0 and sorted(k.pending()) == [4]


def test_trainer_hook_saves_the_engine_state_and_export_reads_best(tmp_path):
    from transformers import AutoModelForCausalLM

    from consumers.trainer.export import export_checkpoint
    from stream_rl.demo.tokenizer import build_tokenizer

    base = tmp_path / "base"
    tiny_policy(seed=0).save_pretrained(base)
    build_tokenizer().save_pretrained(base)
    engine = TorchEngine(TrainModule(tiny_policy(seed=3)), trainer_cfg())
    hook = KeepBest(keeper(tmp_path, every=5, before=False), engine, SOLO)
    assert hook.hold(3, 3) is None and hook.keeper.pending() == {}
    assert hook.hold(5, 5) is not None
    append_row(tmp_path, 5, 0.5)
    assert [j.outcome for j in hook.poll()] == ["kept"]
    out = export_checkpoint(hook.keeper.best_dir, base, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[3, 9, 4, 10, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, engine.module.policy(ids).logits, rtol=1e-5, atol=1e-5)
    assert KeepBest(None, engine, SOLO).hold(5, 5) is None  # keep_best unset: nothing held


def test_the_feed_step_skips_bad_foreign_and_repeated_records_with_a_reason():
    from schemas import Heartbeat  # a foreign kind: valid message, not an evaluation

    values = [encode(evaluation(4, 0.5)), b"\x00junk", None, encode(evaluation(2, 0.25, step=3)),
              encode(evaluation(4, 0.75))]
    records = [Record("run.evals", 0, i, None, v) for i, v in enumerate(values)]
    beat = Heartbeat(role="trainer", instance_id="trainer-1a2b3c4d", host="h", pid=1, state="ready",
                     policy_version=0, step=0)
    records.append(Record("run.evals", 0, 5, None, encode(beat)))
    seen = set()
    batch = evaluation_rows(records, seen)
    assert [(r["version"], r["step"], r["metrics"]["heldout/greedy/accuracy"]) for r in batch.rows] == [
        (2, 3, 0.25), (4, 4, 0.5)]  # version order; the second v4 is a retried send
    assert [where for where, _ in batch.skipped] == ["run.evals[0]@1", "run.evals[0]@2", "run.evals[0]@4",
                                                     "run.evals[0]@5"]
    assert "no value" in batch.skipped[1][1] and "read before" in batch.skipped[2][1]
    assert "not an evaluation" in batch.skipped[0][1] and "not an evaluation" in batch.skipped[3][1]
    assert seen == {2, 4} and evaluation_rows(records, seen).rows == []


def load(**overrides):
    return load_config(None, env={}, overrides={k.replace("__", "."): v for k, v in overrides.items()})


def test_config_refuses_a_metric_no_evaluation_produces():
    ok = load(trainer__keep_best=METRIC, eval__k=[1, 2], eval__n=4, run__demo_dir="none",
              eval__sets={"heldout": "x.jsonl"})
    assert ok.trainer.keep_best == METRIC and ok.trainer.keep_best_mode == "max"
    assert load(trainer__keep_best="eval/heldout/pass@2", eval__k=[2]).trainer.keep_best  # demo: set 'heldout'
    for overrides, match in [
        ({"trainer__keep_best": METRIC}, "needs an \\[eval\\] section"),
        ({"trainer__keep_best": "eval/train/pass@1", "eval__k": [1]}, "trainer.keep_best.*'train' is not an eval set"),
        ({"trainer__keep_best": "eval/heldout/pass@8", "eval__k": [1]}, "trainer.keep_best.*metric 'pass@8'"),
        ({"trainer__keep_best": "eval/heldout/greedy/accuracy", "eval__greedy": False}, "greedy/accuracy"),
        ({"trainer__keep_best": "heldout/pass@1"}, "trainer.keep_best"),
    ]:
        with pytest.raises(ConfigError, match=match) as info:
            load(**overrides)
        assert len(str(info.value).splitlines()) == 1
