"""The elastic placement's lease (stream_rl/launch/lease.py): the trainer widens onto every core only while every
lender has lent, a lender never computes while the trainer holds its core (bounded), and without the environment
of `stream-rl run --set run.placement=elastic` nothing happens. Real affinity and real torch threads."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from stream_rl.cli.config import load_config
from stream_rl.config.base import ConfigError
from stream_rl.launch import lease as lease_mod
from stream_rl.launch.lease import BORROWED, Borrower, Lender, lease_env
from stream_rl.launch.placement import plan

CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="widening needs 2 usable cores; this machine has 1")


def _pair(tmp_path, lenders=("produce-0", "score-0")):
    threads: list[int] = []
    borrower = Borrower(tmp_path, len(lenders), frozenset(CORES), threads.append)
    return borrower, [Lender(tmp_path, name, reclaim_timeout_s=5.0) for name in lenders], threads


@pytest.fixture
def narrow_process():
    """The test process on one core and one thread before, and restored after."""
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {CORES[0]})
    yield frozenset({CORES[0]})
    os.sched_setaffinity(0, before)
    torch.set_num_threads(threads)


@two_cores
def test_the_trainer_widens_only_while_every_lender_has_lent_and_narrows_back(tmp_path, narrow_process):
    borrower, (producer, scorer), threads = _pair(tmp_path)
    assert not borrower.widen(1) and threads == []  # nobody lent
    producer.lend()
    assert not borrower.widen(1) and not (tmp_path / BORROWED).exists()  # one of two lenders
    scorer.lend()
    assert borrower.widen(1) and borrower.wide and (tmp_path / BORROWED).exists()
    assert os.sched_getaffinity(0) == set(CORES) and threads == [len(CORES)]
    assert borrower.widen(1) and threads == [len(CORES)]  # already wide: nothing changes
    borrower.narrow()
    assert os.sched_getaffinity(0) == narrow_process and threads == [len(CORES), 1]
    assert not (tmp_path / BORROWED).exists() and borrower.wide_updates == 1
    borrower.narrow()  # idempotent
    assert threads == [len(CORES), 1]


@two_cores
def test_real_torch_threads_and_affinity_follow_the_lease(tmp_path, narrow_process):
    torch.set_num_threads(1)
    borrower = Borrower(tmp_path, 1, frozenset(CORES), torch.set_num_threads)
    Lender(tmp_path, "produce-0").lend()
    assert borrower.widen(torch.get_num_threads())
    assert torch.get_num_threads() == len(CORES) and os.sched_getaffinity(0) == set(CORES)
    x = torch.randn(64, 64)
    assert torch.allclose(x @ x, (x.double() @ x.double()).float(), atol=1e-4)  # computes wide
    borrower.narrow()
    assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == narrow_process


@two_cores
def test_a_pinning_that_arrives_while_wide_is_kept_when_the_trainer_narrows(tmp_path, narrow_process):
    os.sched_setaffinity(0, set(CORES))  # before `stream-rl run` pins its roles (at the first step)
    borrower, lenders, _ = _pair(tmp_path, ("produce-0",))
    lenders[0].lend()
    assert borrower.widen(1)
    os.sched_setaffinity(0, {CORES[1]})  # the supervisor pins the trainer mid-step
    borrower.narrow()
    assert os.sched_getaffinity(0) == {CORES[1]}  # its pinning stands, not the unpinned set from before


@two_cores
def test_a_lender_that_reclaims_waits_until_the_trainer_narrows(tmp_path, narrow_process):
    borrower, (producer, scorer), _ = _pair(tmp_path)
    producer.lend()
    scorer.lend()
    assert borrower.widen(1)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (producer.reclaim(), done.set()))
    waiter.start()
    assert not done.wait(0.3), "the producer computed while the trainer held its core"
    assert not (tmp_path / "lent-produce-0").exists()  # the loan is withdrawn at once
    assert not borrower.widen(1) and not borrower.wide  # the trainer's next check narrows
    assert done.wait(5.0)
    waiter.join()
    assert producer.late_reclaims == 0


def test_a_reclaim_is_bounded_when_the_trainer_never_narrows(tmp_path):
    (tmp_path / BORROWED).write_bytes(b"")  # a trainer killed while wide
    lender = Lender(tmp_path, "produce-0", reclaim_timeout_s=0.05)
    lender.lend()
    waited = lender.reclaim()
    assert waited >= 0.05 and lender.late_reclaims == 1
    assert lender.reclaim() == 0.0  # nothing lent: nothing to wait for


def test_lend_is_idempotent_and_close_withdraws_without_waiting(tmp_path):
    (tmp_path / BORROWED).write_bytes(b"")
    lender = Lender(tmp_path, "score-0", reclaim_timeout_s=5.0)
    lender.lend()
    lender.lend()
    assert [p.name for p in tmp_path.glob("lent-*")] == ["lent-score-0"]
    lender.close()
    assert not list(tmp_path.glob("lent-*")) and not lender.lent


def test_without_the_lease_environment_nothing_happens(tmp_path):
    lender, borrower = Lender.from_env({}), Borrower.from_env(torch.set_num_threads, {})
    assert not lender.active and not borrower.active
    lender.lend()
    assert lender.reclaim() == 0.0 and not borrower.widen(1)
    borrower.narrow()
    assert not list(tmp_path.iterdir())


def test_the_environment_names_the_lease_and_is_not_read_as_config(tmp_path):
    trainer = lease_env(tmp_path, "train-0", 3, frozenset({0, 1}))
    producer = lease_env(tmp_path, "produce-0", 3, frozenset({0, 1}))
    assert trainer[lease_mod.ENV_CORES] == "0,1" and trainer[lease_mod.ENV_LENDERS] == "3"
    assert lease_mod.ENV_CORES not in producer and producer[lease_mod.ENV_NAME] == "produce-0"
    assert not any(k.startswith("STREAM_RL_") for k in trainer)  # STREAM_RL_* variables set config fields
    borrower = Borrower.from_env(torch.set_num_threads, trainer)
    assert borrower.active and borrower.lenders == 3 and borrower.cores == {0, 1}
    assert Lender.from_env(producer).name == "produce-0"
    load_config(None, env={**os.environ, **trainer})  # the role's config loads with the lease in its environment


def test_the_elastic_placement_pins_as_auto_and_says_what_it_borrows():
    auto, elastic = plan([0, 1], 1, "auto"), plan([0, 1], 1, "elastic")
    assert (elastic.cores, elastic.threads) == (auto.cores, auto.threads)
    assert elastic.elastic and not auto.elastic and not plan([0], 1, "elastic").elastic  # 1 core: nothing to lend
    assert "elastic" in elastic.describe() and "core(s) 0,1 (2 threads)" in elastic.describe()
    assert "elastic" not in auto.describe()


def test_elastic_with_several_trainer_ranks_is_refused_naming_both_fields():
    with pytest.raises(ConfigError) as err:
        load_config(None, env={}, overrides={"run.placement": "elastic", "run.trainer_ranks": 2})
    assert "run.placement" in str(err.value) and "run.trainer_ranks" in str(err.value)
    assert load_config(None, env={}, overrides={"run.placement": "elastic"}).run.placement == "elastic"

