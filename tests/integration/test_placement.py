"""`stream-rl run`'s placement: which cores and threads each role gets, partitions per consumer, real pinning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from stream_rl.launch.placement import pin_tree, plan, sized_partitions


def test_two_cores_give_the_trainer_one_and_the_producers_the_other():
    chosen = plan([0, 1], trainer_ranks=1)
    assert chosen.cores == {"train": {0}, "produce": {1}, "score": frozenset()}  # scorers float
    assert chosen.threads == {"train": 1, "produce": 1, "score": 1}
    assert "train on core(s) 0" in chosen.describe() and "produce on core(s) 1" in chosen.describe()


@pytest.mark.parametrize("cores, ranks, train, produce, threads", [
    (4, 1, {0, 1}, {2, 3}, 2),             # more than twice the ranks: half the cores train
    (8, 2, {0, 1, 2, 3}, {4, 5, 6, 7}, 2),  # two ranks share four cores, two threads each
    (3, 2, {0, 1}, {2}, 1),                # all but one core train
])
def test_larger_machines_split_cores_between_trainer_ranks_and_producers(cores, ranks, train, produce, threads):
    chosen = plan(list(range(cores)), trainer_ranks=ranks)
    assert chosen.cores["train"] == train and chosen.cores["produce"] == produce
    assert chosen.threads["train"] == threads and chosen.threads["produce"] == 1
    assert not chosen.cores["train"] & chosen.cores["produce"]


@pytest.mark.parametrize("cores, ranks, mode", [([0], 1, "auto"), ([0, 1], 2, "auto"), ([0, 1, 2, 3], 1, "none")])
def test_too_few_cores_or_placement_none_pins_nothing(cores, ranks, mode):
    chosen = plan(cores, trainer_ranks=ranks, mode=mode)
    assert all(not c for c in chosen.cores.values()) and set(chosen.threads.values()) == {1}
    assert chosen.describe().startswith("placement: not pinned")


def test_data_topics_get_one_partition_per_consumer_and_the_others_keep_theirs():
    given = {"prompts": 4, "rollouts": 4, "scored": 4, "weights": 1, "dlq": 1}
    assert sized_partitions(given, producers=2, scorers=3) == {"prompts": 2, "rollouts": 3, "scored": 1,
                                                               "weights": 1, "dlq": 1}


def _dry_run(*sets: str) -> dict:
    from typer.testing import CliRunner

    from stream_rl.cli.main import app

    args = ["run", "--dry-run", "--set", "run.demo_dir=null", "--set", "run.prompts_file=p.jsonl"]
    for s in sets:
        args += ["--set", s]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_run_sizes_partitions_unless_the_user_set_them_or_placement_is_none():
    assert _dry_run("run.scorers=2")["topics"]["partitions"]["rollouts"] == 2
    assert _dry_run("run.scorers=2")["topics"]["partitions"]["scored"] == 1
    assert _dry_run("topics.partitions.rollouts=8")["topics"]["partitions"] == {
        **_dry_run("run.placement=none")["topics"]["partitions"], "rollouts": 8}
    assert _dry_run("run.placement=none")["topics"]["partitions"]["prompts"] == 4  # the defaults stay


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux affinity and at least 2 usable cores")
def test_pin_tree_moves_a_process_and_its_children():
    core = max(os.sched_getaffinity(0))
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']);"
            "print(c.pid, flush=True); time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        pin_tree(parent.pid, frozenset({core}))
        time.sleep(0.1)
        assert os.sched_getaffinity(parent.pid) == {core}
        assert os.sched_getaffinity(child) == {core}  # the child (a trainer's rank under its launcher) too
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
