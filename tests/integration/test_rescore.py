"""`stream-rl rescore` against the real broker: a run's logged rollouts scored again with another reward into a new
run (or topic), once each, in a group of its own, while the source run's topics and groups stay as they were; the
offset range options; refusals as one line naming the option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from support import messages as samples
from support.scorer import send_rollouts as send
from support.topics import caught_up, committed, read_records
from typer.testing import CliRunner

from consumers.scorer.config import ScorerConfig
from stream_rl.cli.main import app
from stream_rl.transport.client import Transport

THIS = __name__  # importable by the reward loader: pytest puts tests/ on sys.path


def length_reward(prompt, response, answer, metadata):
    """The rescore's reward: the response's length in characters (hand-checkable)."""
    if metadata.get("poison") == "raise":
        raise ZeroDivisionError("poisoned")
    return float(len(response))


def rollout(i: int, sample: int = 0, **meta):
    """``p{i}`` sample ``sample`` whose response is ``i + sample + 1`` characters long."""
    return replace(samples.rollout(i, sample), response_text="x" * (i + sample + 1), metadata=dict(meta))


def run_topics_state(t: Transport) -> dict[str, list[int]]:
    """High-water marks of every topic of ``t``'s run: any write into the run changes them."""
    admin = t.admin()
    try:
        topics = sorted(x for x in admin.list_topics() if t.names.logical(x) is not None)
    finally:
        admin.close()
    with t.reader() as reader:
        return {topic: list(reader.highwaters(reader.partitions(topic)).values()) for topic in topics}


def score_source_run(cfg, t: Transport, count: int) -> None:
    """The source run's own scorer (exact match) scores its rollouts and commits, in the run's scorers group."""
    from consumers.scorer.scorer import run_scorer

    stop, errors = threading.Event(), []
    scfg = ScorerConfig(reward_fn="consumers.scorer.builtin_rewards:exact_match", batch_size=8, poll_timeout_s=0.3)

    def _run():
        try:
            run_scorer(cfg, scfg, stop)
        except BaseException as exc:  # handed to the test thread below
            errors.append(exc)

    thread = threading.Thread(target=_run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while len(read_records(t, t.names.scored, "scored_rollout")) < count and not errors:
        assert time.monotonic() < deadline, "the source run's scorer did not score its rollouts"
        time.sleep(0.3)
    stop.set()
    thread.join(30)
    assert not errors, errors
    assert caught_up(t, t.names.group("scorers"), t.names.rollouts)  # it stopped after committing what it scored


def rescore(cfg, *args: str):
    return CliRunner().invoke(app, ["rescore", "-b", cfg.kafka.bootstrap_servers, "--from-run", cfg.topics.run,
                                    "--set", "run.demo_dir=null", "--set", f"run_dir={cfg.run_dir}", *args])


def scored_in(t: Transport, topic: str) -> list:
    return read_records(t, topic, "scored_rollout")


# ---------------------------------------------------------------- against the broker


@pytest.mark.broker
def test_rescore_into_a_new_run_leaves_the_source_run_untouched(make_config, run_name):
    cfg = make_config(**{"topics.partitions": {"rollouts": 2, "scored": 2, "dlq": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    first = [rollout(i, s) for i in range(3) for s in range(4)]  # rewards 1..7 by length, 0 by exact match
    send(t, first)
    score_source_run(cfg, t, len(first))
    scorers = t.names.group("scorers")
    source_commits, source_state = committed(t, scorers), run_topics_state(t)
    assert sum(source_commits.values()) == len(first)
    new_run = f"{run_name}-rescored"

    out = rescore(cfg, "--to-run", new_run, "--reward", f"{THIS}:length_reward")
    assert out.exit_code == 0, out.output
    target = Transport(make_config(**{"topics.run": new_run}), "test")
    group = f"{target.names.scored}.rescore"
    assert out.stdout.strip() == (f"rescored {t.names.rollouts} -> {target.names.scored}: read 12, scored 12, "
                                  f"dead-lettered 0 ({target.names.dlq}); group {group}")
    got = scored_in(t, target.names.scored)
    assert Counter(s.value.rollout_id for s in got) == Counter(r.rollout_id for r in first)  # each once
    expected = {r.rollout_id: float(len(r.response_text)) for r in first}
    for s in got:
        assert s.value.reward == expected[s.value.rollout_id] == s.value.reward_components["reward_fn"]
        assert s.key == s.value.group_id.encode() and s.value.scorer_id.startswith("rescore-")
    assert sorted(expected.values()) == [1, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 6]
    # the source run: no topic written to, the scorers' commits as they were; the rescore committed its own group
    assert run_topics_state(t) == source_state and committed(t, scorers) == source_commits
    assert all(s.value.reward == 0.0 for s in scored_in(t, t.names.scored))  # still the exact-match scores
    assert sum(committed(t, group).values()) == len(first)
    assert set(run_topics_state(target)) == {target.names.name(x) for x in  # the new run's trainer finds its topics
                                             ("prompts", "rollouts", "scored", "weights", "dlq", "stale", "status",
                                              "alerts", "evals", "partials", "gateway")}

    again = rescore(cfg, "--to-run", new_run, "--reward", f"{THIS}:length_reward")
    assert again.exit_code == 2
    assert again.stderr.strip() == (f"rescore: --to-run {new_run}: {target.names.scored} already holds 12 records: "
                                    f"pass --append to add to it (continuing group {group}), or choose a new --to-run")
    late = [rollout(7, 0), rollout(7, 1)]
    send(t, late)
    appended = rescore(cfg, "--to-run", new_run, "--reward", f"{THIS}:length_reward", "--append")
    assert appended.exit_code == 0, appended.output
    assert "read 2, scored 2, dead-lettered 0" in appended.stdout  # the committed 12 are not read again
    counts = Counter(s.value.rollout_id for s in scored_in(t, target.names.scored))
    assert counts == Counter(r.rollout_id for r in first + late)
    assert committed(t, scorers) == source_commits


@pytest.mark.broker
def test_offset_range_into_a_topic_with_dead_letters(make_config, run_name):
    cfg = make_config(**{"topics.partitions": {"rollouts": 2, "scored": 2, "dlq": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    p0 = [rollout(i, 0) for i in range(5)]  # partition 0, offsets 0..4
    p1 = [rollout(10, 0), rollout(11, 0, poison="raise"), rollout(12, 0)]  # partition 1, offsets 0..2
    send(t, p0, partition=0)
    send(t, p1, partition=1)
    sink = t.sink()
    sink.send_raw(t.names.rollouts, b"\xc1not msgpack", key=b"junk", partition=0)  # partition 0, offset 5
    sink.flush()
    sink.close()
    topic = f"rescored-{run_name}"

    out = rescore(cfg, "--to-topic", topic, "--reward", f"{THIS}:length_reward", "--from-offset", "0:3",
                  "--until-offset", "1:2")
    assert out.exit_code == 0, out.output
    # partition 0 from offset 3 (3, 4 and the undecodable 5), partition 1 up to offset 2 (0, and 1 which raises)
    assert out.stdout.strip().endswith(f"read 5, scored 3, dead-lettered 2 ({topic}.dlq); group {topic}.rescore")
    got = {s.value.rollout_id: s.value.reward for s in scored_in(t, topic)}
    assert got == {p0[3].rollout_id: 4.0, p0[4].rollout_id: 5.0, p1[0].rollout_id: 11.0}
    letters = sorted((d.value.source_partition, d.value.source_offset, d.value.error_type)
                     for d in read_records(t, f"{topic}.dlq", "dead_letter"))
    assert letters == [(0, 5, "SchemaError"), (1, 1, "ZeroDivisionError")]
    assert not read_records(t, t.names.dlq)  # nothing went to the source run's DLQ
    notices = [r for r in read_records(t, topic) if r.key == p1[1].group_id.encode()]
    assert len(notices) == 1  # the poisoned rollout's group is rejected on the target, as the scorer does
    assert committed(t, f"{topic}.rescore") == {(t.names.rollouts, 0): 6, (t.names.rollouts, 1): 2}


# ---------------------------------------------------------------- refusals through the command line


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAM_RL_")}
    return subprocess.run([sys.executable, "-m", "stream_rl.cli.main", "rescore", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=90, env=env)


def one_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--to-run", "new", "--reward", "no_such_module:fn"], "--reward: reward function reference "
                                                           "'no_such_module:fn': module 'no_such_module' not found"),
    (["--to-run", "new", "--reward", "exact"], "--reward: reward 'exact' is neither a built-in reward"),
    (["--to-run", "SRC"], "--to-run SRC is the source run"),
    (["--to-topic", "stream-rl.SRC.scored"], "--to-topic stream-rl.SRC.scored: stream-rl.SRC.scored is a topic of "
                                             "the source run SRC"),
    (["--to-run", "new", "--group", "stream-rl.SRC.scorers"], "--group stream-rl.SRC.scorers is a consumer group "
                                                              "of run SRC"),
    (["--to-run", "new", "--from-offset", "0:x"], "--from-offset '0:x': expected earliest"),
    (["--to-run", "new", "--to-topic", "t"], "give exactly one of --to-run"),
])
def test_bad_options_are_one_line_before_any_broker(tmp_path, args, needle):
    result = cli("--from-run", "SRC", "-b", "127.0.0.1:1", *args, cwd=tmp_path)  # nothing listens there
    assert result.returncode == 2
    line = one_line(result)
    assert line.startswith("rescore: ") and needle in line, line


@pytest.mark.broker
def test_an_unknown_source_run_is_one_line(broker, tmp_path, run_name):
    result = cli("--from-run", run_name, "--to-run", f"{run_name}-b", "-b", broker.bootstrap, cwd=tmp_path)
    assert result.returncode == 2
    assert one_line(result) == (f"rescore: --from-run {run_name}: topic stream-rl.{run_name}.rollouts does not "
                                f"exist on {broker.bootstrap} (`stream-rl topics list --all` lists the topics)")


def test_dry_run_prints_the_plan(tmp_path):
    result = cli("--from-run", "SRC", "--to-run", "NEW", "--reward", "last_number_match", "--from-offset", "0:3",
                 "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["source_topic"] == "stream-rl.SRC.rollouts" and plan["scored_topic"] == "stream-rl.NEW.scored"
    assert plan["dlq_topic"] == "stream-rl.NEW.dlq" and plan["group"] == "stream-rl.NEW.scored.rescore"
    assert plan["reward_fn"] == "last_number_match"  # a short name of stream_rl.rewards.names, as the scorer takes it
    assert plan["from_offset"] == "0:3" and plan["append"] is False
