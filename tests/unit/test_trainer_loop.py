"""The trainer loop on the in-process bus (``memory://``, proved equal to the broker by
tests/integration/test_edge_contract.py): steps, stale drops with re-queue, weights, checkpoint, resume.

The same role code as on the broker (:func:`~consumers.trainer.trainer.run_trainer` on a thread, the transport
edge, the weights publisher, checkpoints); only the clients under the edge are the bus's. The one real-broker run
of the trainer is tests/integration/test_trainer_broker.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from support.topics import committed, read_values
from support.trainer_loop import finish, metric_rows, send_groups, start
from support.waiting import wait_for

from consumers.trainer.ledger import Ledger, split_rollout_id
from consumers.trainer.trainer import trainer_group
from schemas import group_id_for, rollout_id_for
from stream_rl.storage.checkpoint import complete_checkpoints, load_checkpoint
from stream_rl.transport.client import Transport

torch.set_num_threads(1)


def test_trainer_loop_trains_drops_stale_groups_broadcasts_checkpoints_and_resumes(make_config, model_dir):
    cfg = make_config(**{"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 2,
                         "trainer.max_steps": 3, "trainer.checkpoint_every": 2, "trainer.max_lag": 0,
                         "trainer.micro_batch_size": 2, "trainer.poll_timeout_s": 0.2, "trainer.lr": 1e-3,
                         "topics.partitions.scored": 1, "tracing.exporter": "jsonl"})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    # phase 1: A, B train at step 1 (version 0 -> 1); C, D, E become stale (max_lag 0); a duplicate of A
    send_groups(transport, sink, [0, 1, 2, 3, 4], version=0, duplicate_of=0)
    run = start(cfg)
    wait_for(lambda: len(metric_rows(cfg)) >= 1, "step 1")
    send_groups(transport, sink, [5, 6], version=1)  # phase 2: step 2, checkpoint
    wait_for(lambda: len(metric_rows(cfg)) >= 2, "step 2")
    send_groups(transport, sink, [7, 8], version=2)  # phase 3: step 3, final checkpoint
    state = finish(*run)
    assert (state.step, state.version) == (3, 3)

    rows = metric_rows(cfg)
    assert [(r["step"], r["policy_version"]) for r in rows] == [(1, 1), (2, 2), (3, 3)]
    for key in ("reward/mean", "reward/group_success_rate", "advantage/std", "loss/total", "policy/clipfrac",
                "policy/approx_kl", "policy/is_weight_mean", "kl/ref_mean", "policy/entropy",
                "response/length_mean", "staleness/mean_lag", "staleness/max_lag", "mismatch/logp_abs_diff",
                "mismatch/kl_mu_prox", "optim/grad_norm", "optim/lr", "throughput/train_tokens_per_s",
                "throughput/generate_tokens_per_s", "time/generate_s_mean", "time/score_s_mean", "time/wait_s",
                "time/broadcast_s", "time/step_s", "weights/sent_bytes"):
        assert key in rows[-1], key
    assert all(r["weights/sent_bytes"] > 0 for r in rows)  # every step published a version (inline, full)
    assert rows[0]["reward/mean"] == 0.5 and rows[-1]["batcher/duplicates_total"] == 1.0

    spans = [json.loads(line) for line in (Path(cfg.run_dir) / "spans.jsonl").read_text().splitlines()]
    sent = {sp["span_id"] for sp in spans if sp["service"] == "test" and sp["kind"] == "PRODUCER"}
    steps = [sp for sp in spans if sp["service"] == "trainer" and sp["name"] == "process train-step"]
    assert len(steps) == 3 and all(len(sp["links"]) == 4 for sp in steps)  # one link per trained rollout
    assert all(link["span_id"] in sent for sp in steps for link in sp["links"])
    # a step's broadcast continues the step's trace: the manifest's send span descends from the train-step span
    by_id = {sp["span_id"]: sp for sp in spans}
    broadcasts = [sp for sp in spans if sp["service"] == "trainer" and sp["name"] == "process broadcast"]
    assert sorted(by_id[b["parent_id"]]["name"] for b in broadcasts) == ["process train-step"] * 3
    manifest_sends = [sp for sp in spans if sp["service"] == "trainer" and sp["kind"] == "PRODUCER"
                      and sp["name"] == f"send {transport.names.weights}"]
    assert manifest_sends and all(by_id[sp["parent_id"]]["name"] == "process broadcast" for sp in manifest_sends)
    # a stale drop continues a trace: the rollout's that caused it, or the step's whose broadcast expired it
    stale_sends = [sp for sp in spans if sp["service"] == "trainer" and sp["name"] == f"send {transport.names.stale}"]
    parents = [by_id[sp["parent_id"]] for sp in stale_sends]
    assert stale_sends and {p["name"] for p in parents} <= {"process drop", "process broadcast"}
    sent_traces = {sp["trace_id"] for sp in spans if sp["service"] == "test" and sp["kind"] == "PRODUCER"}
    step_traces = {sp["trace_id"] for sp in steps}
    assert all(p["trace_id"] in (sent_traces if p["name"] == "process drop" else step_traces) for p in parents)

    stale = read_values(transport, transport.names.stale, "stale_rollout")
    assert sorted(s.rollout_id for s in stale) == sorted(rollout_id_for(f"p{p}", 0, s) for p in (2, 3, 4)
                                                         for s in range(2))
    assert all(s.requeued and s.max_lag == 0 and s.lag == 1 for s in stale)
    prompts = read_values(transport, transport.names.prompts, "prompt")
    assert sorted((p.prompt_id, p.attempt) for p in prompts) == [("p2", 1), ("p3", 1), ("p4", 1)]
    manifests = read_values(transport, transport.names.weights, "weights_manifest")
    assert [m.version for m in manifests] == [1, 2, 3] and [m.step for m in manifests] == [1, 2, 3]

    root = Path(cfg.run_dir) / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000002", "step-00000003"]
    last = load_checkpoint(root / "step-00000003")
    topic = transport.names.scored
    assert last.offsets == {(topic, 0): 19} and last.version == 3
    trained = {rollout_id_for(f"p{p}", 0, s) for p in (0, 1, 5, 6, 7, 8) for s in range(2)}
    assert Ledger.from_json(last.ledger["groups"]).groups() == {split_rollout_id(r) for r in trained}
    assert last.ledger["requeued"] == {group_id_for(f"p{p}", 0): 0 for p in (2, 3, 4)}
    assert committed(transport, trainer_group(cfg)) == {(topic, 0): 19}

    # resume from the step-2 checkpoint as if the trainer died after publishing v3 but before checkpointing:
    # the committed offset (19) is past H, I, but the checkpoint (15) is the truth, and v3 must not be reused
    shutil.rmtree(root / "step-00000003")
    cfg2 = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"max_lag": 4})})
    state = finish(*start(cfg2, resume=True))
    assert (state.step, state.version) == (3, 5)
    rows = metric_rows(cfg)
    # the resume truncated the history to the checkpoint's step (2), then step 3 was trained again at v5
    assert [(r["step"], r["policy_version"]) for r in rows] == [(1, 1), (2, 2), (3, 5)]
    # H, I (version 2) trained at version 4, which is version 2's weights republished: lag 0 along the lineage
    assert rows[-1]["staleness/max_lag"] == 0.0
    assert [m.version for m in read_values(transport, transport.names.weights, "weights_manifest")] == [1, 2, 3, 4, 5]
    assert len(read_values(transport, transport.names.stale, "stale_rollout")) == 6  # nothing re-read before 15
    resumed = load_checkpoint(root / "step-00000003")
    assert Ledger.from_json(resumed.ledger["groups"]).groups() == {split_rollout_id(r) for r in trained}
    assert resumed.step == 3
    sink.close()
