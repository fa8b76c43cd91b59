"""The scorer loop on the real broker: keyed outputs, traces continued, restarts that re-read nothing, poisoned
rewards dead-lettered, two scorers sharing a group, batch counting. The pure step, reward references and models:
tests/unit/test_scoring_step.py."""

from __future__ import annotations

import itertools
import sys
import time
from collections import Counter

import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.messages import rollout_for_scoring
from support.scorer import ScorerThread, group_rollouts, send_rollouts, trace_id
from support.topics import caught_up, check_role_telemetry, heartbeats, only_export, read_records
from support.waiting import wait_for

from consumers.scorer.config import ScorerConfig
from schemas import DeadLetter, decode
from stream_rl.transport.client import Transport
from stream_rl.transport.tracing import Tracing

torch.set_num_threads(1)


# ---------------------------------------------------------------- the loop on the real broker


@pytest.mark.broker
def test_loop_scores_keyed_by_group_continues_traces_and_a_restart_rereads_nothing(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 2, "scored": 2}})
    t = Transport(cfg, "test", tracing=Tracing("producer-test"))
    t.ensure_topics()
    first_batch = group_rollouts(0, 3)
    send_rollouts(t, first_batch)
    exporter = InMemorySpanExporter()
    scfg = ScorerConfig(reward_fn="consumers.scorer.builtin_rewards:exact_match", batch_size=5, poll_timeout_s=0.3)
    scorer = ScorerThread(cfg, scfg, Tracing("scorer-test", exporter))
    scored = wait_for(lambda: (s := read_records(t, t.names.scored, "scored_rollout")) and len(s) >= 12 and s,
                      "12 scored rollouts", 40, watch=[scorer])
    stats = scorer.finish()
    assert stats.scored == 12 and stats.rejected == 0 and stats.commits >= 1 and stats.lost_commits == 0
    assert sorted(s.value.rollout_id for s in scored) == sorted(r.rollout_id for r in first_batch)
    for s in scored:
        assert s.key == s.value.group_id.encode()
        assert s.value.reward == (1.0 if s.value.rollout.sample_index % 2 == 0 else 0.0)
        assert s.value.scorer_id.startswith("scorer-")
    assert len({(s.value.group_id, s.partition) for s in scored}) == 3  # each group on one partition
    # each scored record continues its rollout's trace; its "process score" span is the rollout send's child
    sent = {r.value.rollout_id: r.headers for r in read_records(t, t.names.rollouts, "rollout")}
    assert all(trace_id(s.headers) == trace_id(sent[s.value.rollout_id]) for s in scored)
    send_span_ids = {dict(h)["traceparent"].decode().split("-")[2] for h in sent.values()}
    per_record = [sp for sp in exporter.get_finished_spans() if sp.name == "process score"]
    assert len(per_record) == 12 and {f"{sp.parent.span_id:016x}" for sp in per_record} == send_span_ids
    check_role_telemetry(cfg, t, "scorer", topic_in=t.names.rollouts, records_in=12, topic_out=t.names.scored,
                         records_out=12, tokens=sum(r.response_length for r in first_batch), stage="score",
                         batches=stats.batches)
    instance, _ = only_export(cfg.run_dir)
    assert heartbeats(t, instance)[-1].step == stats.batches  # heartbeats report the batch counter

    # restart in the same group: only the new rollouts are scored, nothing committed before is read again
    scorer = ScorerThread(cfg, scfg)
    second_batch = group_rollouts(10, 1)
    send_rollouts(t, second_batch)
    wait_for(lambda: len(read_records(t, t.names.scored, "scored_rollout")) >= 16, "4 more scored rollouts", 40,
             watch=[scorer])
    wait_for(lambda: caught_up(t, t.names.group("scorers"), t.names.rollouts), "the scorers' commits at the end of "
             "every partition", 40, watch=[scorer])  # anything read again would have been scored before this
    stats = scorer.finish()
    assert stats.scored == 4
    ids = [s.value.rollout_id for s in read_records(t, t.names.scored, "scored_rollout")]
    assert sorted(ids) == sorted(r.rollout_id for r in first_batch + second_batch)


@pytest.mark.broker
def test_nan_reward_sends_that_rollout_to_the_dlq_and_scores_the_others(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 2, "scored": 2, "dlq": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    rollouts = group_rollouts(0, 2)
    poisoned = [rollout_for_scoring(5, s, metadata={"poison": "nan"}) for s in (0, 1)]
    acks = send_rollouts(t, rollouts + poisoned)
    sink = t.sink()
    sink.send_raw(t.names.rollouts, b"\xc1not msgpack", key=b"junk", partition=0)
    sink.flush()
    sink.close()
    scorer = ScorerThread(cfg, ScorerConfig(reward_fn="support.scorer:poisonable_reward", batch_size=4,
                                            poll_timeout_s=0.3))
    wait_for(lambda: len(read_records(t, t.names.scored, "scored_rollout")) >= 8
             and len(read_records(t, t.names.dlq, "dead_letter")) >= 3, "8 scored and 3 dead letters", 40,
             watch=[scorer])
    stats = scorer.finish()
    assert (stats.scored, stats.rejected) == (8, 2)
    scored = read_records(t, t.names.scored, "scored_rollout")
    assert sorted(s.value.rollout_id for s in scored) == sorted(r.rollout_id for r in rollouts)
    letters: list[DeadLetter] = [d.value for d in read_records(t, t.names.dlq, "dead_letter")]
    reward_letters = [d for d in letters if d.error_type == "RewardValueError"]
    assert len(reward_letters) == 2 and len(letters) == 3
    where = {(a.partition, a.offset) for a in acks[-2:]}
    assert {(d.source_partition, d.source_offset) for d in reward_letters} == where
    for d in reward_letters:
        assert "non-finite reward nan" in d.reason and d.source_topic == t.names.rollouts
        assert decode(d.raw_value, "rollout") in poisoned and d.raw_key == poisoned[0].group_id.encode()


@pytest.mark.broker
def test_an_unrouted_rollout_is_dead_lettered_with_its_source_and_its_group_rejected(make_config):
    """scorer.rewards on the real broker: a routed group is scored by its route, a group whose data_source has no
    route (and no default) is dead-lettered with the key and value, and each of its members gets a MemberRejected."""
    cfg = make_config(**{"topics.partitions": {"rollouts": 1, "scored": 1, "dlq": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    routed = group_rollouts(0, 1, metadata={"data_source": "openai/gsm8k"})  # responses "7" / "8", answer "7"
    unrouted = group_rollouts(1, 1, metadata={"data_source": "poetry"})
    send_rollouts(t, routed + unrouted)
    scorer = ScorerThread(cfg, ScorerConfig(rewards={"routes": {"openai/gsm8k": [{"fn": "gsm8k", "weight": 2.0}]}},
                                            batch_size=8, poll_timeout_s=0.3))
    wait_for(lambda: len(read_records(t, t.names.dlq, "dead_letter")) >= 4
             and len(read_records(t, t.names.scored)) >= 8, "4 scored, 4 notices and 4 dead letters", 40,
             watch=[scorer])
    stats = scorer.finish()
    assert (stats.scored, stats.rejected) == (4, 4)
    scored = read_records(t, t.names.scored, "scored_rollout")
    assert sorted((s.value.rollout_id, s.value.reward_components) for s in scored) == sorted(
        (r.rollout_id, {"gsm8k": 2.0 if r.response_text == "7" else 0.0}) for r in routed)
    reason = ("no reward route for data_source='poetry' (scorer.rewards.by = 'data_source'; routes: "
              "['openai/gsm8k']; no default)")
    letters = [d.value for d in read_records(t, t.names.dlq, "dead_letter")]
    assert [(d.error_type, d.reason) for d in letters] == [("UnroutedError", reason)] * 4
    unrouted_ids = sorted(r.rollout_id for r in unrouted)
    assert sorted(decode(d.raw_value, "rollout").rollout_id for d in letters) == unrouted_ids
    notices = [decode(r.value) for r in read_records(t, t.names.scored)]
    notices = [n for n in notices if n.KIND == "member_rejected"]
    assert sorted(n.rollout_id for n in notices) == unrouted_ids
    assert {(n.group_id, n.error_type, n.reason) for n in notices} == {(unrouted[0].group_id, "UnroutedError", reason)}


@pytest.mark.broker
def test_two_scorers_in_one_group_score_every_rollout_exactly_once(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 4, "scored": 4}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    scfg = dict(reward_fn="consumers.scorer.builtin_rewards:exact_match", batch_size=4, poll_timeout_s=0.3)
    scorers = [ScorerThread(cfg, ScorerConfig(scorer_id=name, **scfg)) for name in ("scorer-a", "scorer-b")]

    # let the group settle: warm-up rollouts on every partition until both scorers have scored some
    rounds = itertools.count()

    def both_settled():
        first = 1000 + 4 * next(rounds)
        for partition in range(4):
            send_rollouts(t, [rollout_for_scoring(first + partition)], partition=partition)
        time.sleep(1.0)
        return {s.value.scorer_id for s in read_records(t, t.names.scored, "scored_rollout")} == {"scorer-a",
                                                                                                  "scorer-b"}
    wait_for(both_settled, "both scorers to own partitions", 45, watch=scorers)

    main = group_rollouts(4, 10)  # groups q4..q13 hash onto all four partitions
    acks = send_rollouts(t, main)
    assert {a.partition for a in acks} == {0, 1, 2, 3}  # the groups cover every partition
    main_ids = {r.rollout_id for r in main}
    wait_for(lambda: main_ids <= {s.value.rollout_id for s in read_records(t, t.names.scored, "scored_rollout")},
             "every rollout scored", 40, watch=scorers)
    wait_for(lambda: caught_up(t, t.names.group("scorers"), t.names.rollouts), "the scorers' commits at the end of "
             "every partition", 40, watch=scorers)  # a duplicate would have been scored before this
    for scorer in scorers:
        scorer.finish()
    scored = [s for s in read_records(t, t.names.scored, "scored_rollout") if s.value.rollout_id in main_ids]
    counts = Counter(s.value.rollout_id for s in scored)
    assert set(counts) == main_ids and set(counts.values()) == {1}, counts.most_common(3)
    by_scorer = Counter(s.value.scorer_id for s in scored)
    assert set(by_scorer) == {"scorer-a", "scorer-b"}, by_scorer  # the work was shared
    partition_of = {r.rollout_id: a.partition for r, a in zip(main, acks, strict=True)}
    owners = {}
    for s in scored:
        owners.setdefault(partition_of[s.value.rollout_id], set()).add(s.value.scorer_id)
    assert all(len(names) == 1 for names in owners.values()), owners  # one owner per partition


@pytest.mark.broker
def test_score_max_batches_counts_a_batch_of_dead_letters_only(make_config, broker, run_name, tmp_path):
    """Issue 13: `stream-rl score --max-batches 1` on a topic holding only undecodable records waited forever;
    a poll whose records were all dead-lettered is a batch."""
    import os
    import subprocess

    cfg = make_config(**{"topics.partitions": {"rollouts": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    sink = t.sink()
    for i in range(3):
        sink.send_raw(t.names.rollouts, b"\xc1not msgpack %d" % i, key=b"junk", partition=0)
    sink.flush()
    sink.close()
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "score", "--max-batches", "1", "-b", broker.bootstrap,
           "--run", run_name, "--set", "run.demo_dir=null", "--set", f"run_dir={tmp_path / 'run'}",
           "--set", "scorer.poll_timeout_s=0.5"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_RL_")}
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=tmp_path, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("score --max-batches 1 never ended on a batch of dead letters") from exc
    assert result.returncode == 0, result.stderr
    letters = read_records(t, t.names.dlq, "dead_letter")
    assert len(letters) == 3 and {d.value.source_offset for d in letters} == {0, 1, 2}


@pytest.mark.broker
@pytest.mark.parametrize("in_flight", [1, 3])
def test_batches_in_flight_overlap_slow_reward_calls_and_commit_in_poll_order(make_config, in_flight):
    from support import slow_rewards

    cfg = make_config()
    t = Transport(cfg, "test")
    t.ensure_topics()
    rollouts = group_rollouts(0, 6)  # 24 rollouts: 6 batches of 4, one 0.4 s reward call each
    send_rollouts(t, rollouts)
    slow_rewards.OVERLAP.now = slow_rewards.OVERLAP.peak = 0
    scfg = ScorerConfig(reward_fn="support.slow_rewards:slow_batch", batch_size=4, poll_timeout_s=0.3,
                        batches_in_flight=in_flight)
    scorer = ScorerThread(cfg, scfg)
    wait_for(lambda: caught_up(t, t.names.group("scorers"), t.names.rollouts), "the scorers' commits at the end of "
             "every partition", 60, watch=[scorer])
    stats = scorer.finish()
    scored = read_records(t, t.names.scored, "scored_rollout")
    assert sorted(s.value.rollout_id for s in scored) == sorted(r.rollout_id for r in rollouts)  # once each
    assert stats.scored == 24 and stats.rejected == 0 and stats.lost_commits == 0
    assert all(s.value.reward == (1.0 if s.value.rollout.sample_index % 2 == 0 else 0.0) for s in scored)
    # one batch's calls at a time, or several batches' calls overlapping (the scorer polls while they run)
    assert slow_rewards.OVERLAP.peak == 1 if in_flight == 1 else slow_rewards.OVERLAP.peak >= 2
    # sent in poll order: within a partition, scored records follow their rollouts' order
    order = {r.rollout_id: i for i, r in enumerate(rollouts)}
    by_partition: dict = {}
    for s in scored:
        by_partition.setdefault(s.partition, []).append(order[s.value.rollout_id])
    assert all(seq == sorted(seq) for seq in by_partition.values())
    # one ``score`` stage timing per batch sent, in either loop
    check_role_telemetry(cfg, t, "scorer", topic_in=t.names.rollouts, records_in=24, topic_out=t.names.scored,
                         records_out=24, tokens=sum(r.response_length for r in rollouts), stage="score",
                         batches=stats.batches)
