"""The evaluator publishes heartbeats of role ``evaluator`` like the other roles (on the in-process bus), and
``stream-rl status``'s snapshot lists it with its last evaluated version, its evaluations and its staleness."""

from __future__ import annotations

import threading

import pytest
from support.evaluation import eval_section, write_prompts
from support.producers import build_tiny_model_dir, perturbed_state_dict
from support.topics import read_records

from producers.engines.hf import HFEngine
from evaluator.role import EvaluatorDeps, EvaluatorStats, run_evaluator
from schemas import ROLES, Heartbeat, SchemaError, decode, encode
from stream_rl.operator_tools.status import build_snapshot
from stream_rl.transport import memory
from stream_rl.transport.client import Transport


@pytest.fixture
def cfg(tmp_path, run_name):
    from support.memory_bus import memory_config

    model_dir = build_tiny_model_dir(tmp_path / "tiny")
    prompts = write_prompts(tmp_path / "heldout.jsonl", count=4)
    yield memory_config(run_name, tmp_path / "run", **{
        "producer.model_dir": str(model_dir), "weights.mode": "inline", "weights.chunk_size": 200_000,
        "telemetry.heartbeat_interval_s": 0.2, "eval": eval_section(prompts)})
    memory.reset(run_name)


def test_the_evaluator_role_is_a_heartbeat_role_on_the_wire():
    assert "evaluator" in ROLES
    beat = Heartbeat(role="evaluator", instance_id="evaluator-1", host="h", pid=1, state="ready", policy_version=4,
                     step=2, metrics={"eval/heldout/pass@1": 0.5})
    assert decode(encode(beat), "heartbeat") == beat
    with pytest.raises(SchemaError, match="role"):
        decode(encode(Heartbeat(role="grader", instance_id="g-1", host="h", pid=1, state="ready",
                                policy_version=0, step=0)), "heartbeat")


def test_the_evaluator_heartbeats_and_status_lists_it(cfg):
    from stream_rl.weights.publisher import WeightsPublisher

    model_dir = cfg.producer.model_dir
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    publisher = WeightsPublisher(transport, sink, cfg.weights, "trainer-0")
    for v in (1, 2, 3):  # every_versions = 2: v0 and v2 are evaluated; v3 is the newest published
        publisher.publish(perturbed_state_dict(model_dir, seed=v), version=v, step=10 * v)
    sink.close()
    stats = EvaluatorStats()
    run_evaluator(cfg, cfg.eval, cfg.producer, threading.Event(), 2,
                  deps=EvaluatorDeps(engine=HFEngine.from_dir(model_dir), stats=stats))
    assert stats.evaluated == [0, 2]
    beats = [r.value for r in read_records(transport, transport.names.status, "heartbeat")]
    mine = [b for b in beats if b.role == "evaluator"]
    assert mine, [b.role for b in beats]
    last = max(mine, key=lambda b: b.created_at)  # the closing heartbeat
    assert (last.state, last.policy_version, last.step) == ("stopping", 2, 2)
    assert last.metrics["eval/version"] == 2.0 and last.metrics["eval/step"] == 20.0
    assert 0.0 <= last.metrics["eval/heldout/pass@1"] <= 1.0
    snap = build_snapshot(run=cfg.topics.run, now=last.created_at, heartbeats=beats, manifest=None, marks={})
    rows = [r for r in snap["roles"] if r["role"] == "evaluator"]
    assert len(rows) == 1 and rows[0]["instance_id"] == last.instance_id
    assert rows[0]["policy_version"] == 2 and rows[0]["step"] == 2 and rows[0]["status"] == "alive"
    from dataclasses import replace

    trainer = replace(last, role="trainer", instance_id="trainer-0", policy_version=5, step=5)
    snap = build_snapshot(run=cfg.topics.run, now=last.created_at, heartbeats=[*beats, trainer], manifest=None,
                          marks={})
    assert {r["role"]: r["staleness"] for r in snap["roles"]}["evaluator"] == 3  # 5 - 2 versions behind
