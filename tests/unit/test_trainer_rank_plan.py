"""Several trainer ranks without starting them: the lockstep plan of rows over ranks and micro-batches, and the
launcher naming the rank that failed on its own."""

from __future__ import annotations

import pytest
import torch

from consumers.trainer.ranks import Ranks


@pytest.mark.parametrize("n_rows,world,micro", [(6, 2, 1), (3, 2, 1), (1, 2, 4), (5, 2, 2), (7, 3, 2), (8, 1, 3),
                                                (64, 4, 8)])
def test_the_lockstep_plan_covers_every_row_once_with_the_same_count_on_every_rank(n_rows, world, micro):
    rows = torch.randperm(n_rows, generator=torch.Generator().manual_seed(n_rows))
    plans = [Ranks(rank=r, world=world).chunks(rows, micro) for r in range(world)]
    assert len({len(p) for p in plans}) == 1  # the same number of forwards/backwards on every rank
    real = torch.cat([idx for plan in plans for idx, is_real in plan if is_real])
    assert sorted(real.tolist()) == sorted(rows.tolist())  # every row exactly once
    assert all(len(idx) <= micro for plan in plans for idx, _ in plan)
    ghosts = [idx for plan in plans for idx, is_real in plan if not is_real]
    assert all(len(g) == 1 and int(g[0]) in rows.tolist() for g in ghosts)
    if world == 1:
        assert not ghosts and [len(i) for i, _ in plans[0]] == [len(p) for p in rows.tensor_split(len(plans[0]))]


def test_the_plan_of_6_rows_on_2_ranks_in_micro_batches_of_1():
    rows = torch.tensor([5, 0, 3, 1, 4, 2])
    assert [i.tolist() for i, _ in Ranks(rank=0, world=2).chunks(rows, 1)] == [[5], [0], [3]]
    assert [i.tolist() for i, _ in Ranks(rank=1, world=2).chunks(rows, 1)] == [[1], [4], [2]]
    half = rows[:3]  # 3 rows: rank 0 takes 2, rank 1 takes 1 and runs one ghost (row 5, weighted 0)
    assert [(i.tolist(), r) for i, r in Ranks(rank=1, world=2).chunks(half, 1)] == [([3], True), ([5], False)]


def test_the_launcher_names_the_rank_that_failed_on_its_own_not_the_peer_that_lost_it():
    from types import SimpleNamespace

    from consumers.trainer.launch import RankDied, _detail, root_cause

    lost = SimpleNamespace(timestamp=10, exitcode=1, message="RankFailure: trainer rank 0 of 2: send STEP failed")
    killed = SimpleNamespace(timestamp=11, exitcode=-9, message="Signal 9 (SIGKILL) received by PID 7")
    rank, failure = root_cause({0: lost, 1: killed})
    assert rank == 1 and str(RankDied(rank, failure.exitcode, _detail(failure))) == (
        "trainer rank 1 failed (killed by SIGKILL); every rank was stopped")
    assert root_cause({0: lost})[0] == 0  # only consequences: the earliest is named
    crashed = SimpleNamespace(timestamp=12, exitcode=1, message="ValueError: trainer.model_dir is not set\nTraceback")
    assert _detail(crashed) == "exit code 1: ValueError: trainer.model_dir is not set"
