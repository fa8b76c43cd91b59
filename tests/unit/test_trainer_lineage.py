"""Staleness across a resume that republished its checkpoint under a new version number (consumers.trainer.lineage).

The defect this guards against: a trainer checkpointed at v25 that had published up to v28 before it crashed
resumes as v29, and everything generated at v24..v28 was dropped as stale at once although its weights were no
further from the resumed weights than before the crash.
"""

from __future__ import annotations

import pytest
from support.trainer import rec, scored

from consumers.trainer.batcher import Batcher, rollout_lag
from consumers.trainer.lineage import Lineage


def test_without_jumps_the_lag_is_the_version_difference():
    assert [Lineage().lag(b, 7) for b in (7, 5, 0, 9)] == [0, 2, 7, -2]


def test_lag_through_one_jump_matches_the_drawing():
    lineage = Lineage.of([(25, 29)])  # 29 = 25's weights; 26..28 died with the crashed trainer
    assert lineage.lag(24, 29) == 1  # as far from the resumed weights as from the checkpoint's
    assert lineage.lag(25, 29) == 0
    assert lineage.lag(27, 29) == 2  # two steps past the branch point on the dead branch
    assert lineage.lag(24, 30) == 2 and lineage.lag(27, 30) == 3 and lineage.lag(29, 30) == 1
    assert lineage.lag(31, 30) == -1  # newer than the trainer: weights it never had


def test_lag_through_two_jumps_adds_the_live_steps_between_them():
    lineage = Lineage.of([(31, 35), (25, 29)])  # given out of order: sorted
    assert lineage.jumps == ((25, 29), (31, 35))
    # 24 -> 25 (1), 25 = 29, 29 -> 31 (2), 31 = 35, 35 -> 36 (1)
    assert lineage.lag(24, 36) == 4
    assert lineage.lag(33, 36) == 2 + 1  # dead branch off 31
    assert lineage.lag(27, 36) == 2 + 3  # 2 steps past 25 on its dead branch; 25 = 29 -> 31 = 35 -> 36: 3


def test_a_jump_must_go_forward():
    with pytest.raises(ValueError, match=r"lineage jump \(5, 5\)"):
        Lineage.of([(5, 5)])


def test_rollout_lag_takes_the_oldest_token_along_the_lineage():
    lineage = Lineage.of([(25, 29)])
    mixed = scored(0, 0, versions=[24, 27])  # weights changed mid-generation
    assert rollout_lag(mixed, 29, lineage) == 2  # 27 is two steps off; 24 only one
    assert rollout_lag(mixed, 29) == 5  # the version difference alone


def test_the_backlog_of_a_resume_is_not_manufactured_stale():
    resumed = Batcher(max_lag=4)
    resumed.lineage = Lineage.of([(25, 29)])
    assert resumed.add(rec(0, 0, 0, version=24), 29) == []
    assert resumed.add(rec(1, 0, 1, version=28), 29) == []
    assert [g.group_id for g in resumed.take(1)] and resumed.counters["stale"] == 0

    naive = Batcher(max_lag=4)  # what the trainer did before: lag 29 - 24 = 5 > 4
    (drop,) = naive.add(rec(0, 0, 0, version=24), 29)
    assert drop.stale[0].reason.startswith("lag 5 > max_lag 4")


def test_the_jumps_travel_in_the_checkpointed_train_state():
    from consumers.trainer.train_step import TrainState

    state = TrainState(step=10, version=29, lineage=[[25, 29]])
    again = TrainState.from_json(state.to_json())
    assert again.lineage == [[25, 29]] and Lineage.of(again.lineage).lag(24, 29) == 1
    assert TrainState.from_json({"step": 3, "version": 3}).lineage == []  # a checkpoint from before lineages
