"""The evaluator role on the in-process bus (``memory://``): it follows published weights versions, evaluates the
due ones, skips the ones it is too slow for and says which, and a second start reads the evals topic and redoes
nothing. The schedule (which version next) is checked as a pure function."""

from __future__ import annotations

import threading

import pytest
from support.evaluation import eval_section, write_prompts
from support.producers import build_tiny_model_dir, perturbed_state_dict

from producers.engines.hf import HFEngine
from evaluator.role import EvaluatorDeps, EvaluatorStats, run_evaluator
from stream_rl.evaluation.ledger import evals_topic, read_done, read_rows
from stream_rl.evaluation.schedule import Plan, plan_next
from stream_rl.transport import memory
from stream_rl.transport.client import Transport


def test_plan_takes_version_zero_first_then_the_newest_due_and_skips_the_rest():
    assert plan_next([], [], 2, before_train=True) == Plan(0)
    assert plan_next([], [], 2, before_train=False) == Plan(None)
    assert plan_next([1, 2, 3], [], 2, before_train=True) == Plan(0)
    assert plan_next([1, 2, 3], [0], 2, before_train=True) == Plan(2)
    assert plan_next([1, 2, 3, 4, 5, 6], [0], 2, before_train=True) == Plan(6, [2, 4])
    assert plan_next([2, 4, 6], [6], 2, before_train=True) == Plan(None)  # older holes are not revisited
    assert plan_next([2, 4, 6], [2, 4, 6], 2, before_train=True) == Plan(None)
    assert plan_next([3, 5], [0], 2, before_train=True) == Plan(None)  # none due
    with pytest.raises(ValueError, match="every_versions"):
        plan_next([1], [], 0, True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def cfg(tmp_path, run_name, model_dir):
    from support.memory_bus import memory_config

    prompts = write_prompts(tmp_path / "heldout.jsonl", count=4)
    yield memory_config(run_name, tmp_path / "run", **{
        "producer.model_dir": str(model_dir), "weights.mode": "inline", "weights.chunk_size": 200_000,
        "eval": eval_section(prompts)})
    memory.reset(run_name)


def _publish(cfg, model_dir, versions):
    from stream_rl.weights.publisher import WeightsPublisher

    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    publisher = WeightsPublisher(transport, sink, cfg.weights, "trainer-0")
    for v in versions:
        publisher.publish(perturbed_state_dict(model_dir, seed=v), version=v, step=10 * v)
    sink.close()


def _run(cfg, model_dir, max_evaluations):
    stats = EvaluatorStats()
    run_evaluator(cfg, cfg.eval, cfg.producer, threading.Event(), max_evaluations,
                  deps=EvaluatorDeps(engine=HFEngine.from_dir(model_dir), stats=stats))
    return stats


def test_evaluates_v0_then_the_newest_due_version_skipping_older_ones_and_records_each_once(cfg, model_dir):
    _publish(cfg, model_dir, [1, 2, 3, 4, 5])  # every_versions = 2: 2 and 4 are due, 4 is the newest
    stats = _run(cfg, model_dir, 2)
    assert stats.evaluated == [0, 4] and stats.skipped == [2]
    transport = Transport(cfg, "test")
    done = read_done(transport, evals_topic(transport))
    assert sorted(done) == [0, 4]
    assert done[4].step == 40 and done[0].step == 0 and done[4].sets == ["heldout"]
    assert done[0].metrics != done[4].metrics  # other weights, other samples (same seeds)
    rows = read_rows(cfg.run_dir / "evals.jsonl")
    assert [(r["version"], r["step"], r["skipped_versions"]) for r in rows] == [(0, 0, []), (4, 40, [2])]
    assert rows[1]["metrics"] == done[4].metrics

    _publish(cfg, model_dir, [6])  # a restart: nothing done is redone, the new due version is evaluated
    again = _run(cfg, model_dir, 1)
    assert again.resumed == [0, 4] and again.evaluated == [6] and again.rows_restored == 0
    assert sorted(read_done(transport, evals_topic(transport))) == [0, 4, 6]
    assert [r["version"] for r in read_rows(cfg.run_dir / "evals.jsonl")] == [0, 4, 6]


def test_a_restart_restores_rows_the_file_lost_and_a_torn_last_line(cfg, model_dir):
    stats = _run(cfg, model_dir, 1)
    assert stats.evaluated == [0]
    path = cfg.run_dir / "evals.jsonl"
    path.write_text('{"version": 0, "ste')  # as if killed while writing the row, after the record was acked
    _publish(cfg, model_dir, [2])
    again = _run(cfg, model_dir, 1)
    assert again.rows_restored == 1 and again.evaluated == [2]
    assert [r["version"] for r in read_rows(path)] == [0, 2]
