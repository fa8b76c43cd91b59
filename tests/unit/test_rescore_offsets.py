"""`stream-rl rescore`'s offsets and ranges, computed per partition without a broker."""

from __future__ import annotations

import pytest

from consumers.scorer.rescore import Offsets, RescoreError, parse_offsets, partition_ranges


def test_offsets_and_ranges_are_computed_per_partition():
    assert parse_offsets("earliest", "--from-offset", "earliest") == Offsets()
    assert parse_offsets("7", "--from-offset", "earliest") == Offsets(7, {})
    assert parse_offsets("0:3, 2:5,1", "--from-offset", "earliest") == Offsets(1, {0: 3, 2: 5})
    for bad in ("x", "0:-1", "-2", "0:", "a:1"):
        with pytest.raises(RescoreError, match="--from-offset"):
            parse_offsets(bad, "--from-offset", "earliest")
    ends = {0: 10, 1: 4, 2: 0}
    # from 0:3 (others earliest), until 1:2 (others the high-water mark); a commit at 6 on partition 0 wins over 3
    assert partition_ranges(ends, Offsets(None, {0: 3}), Offsets(None, {1: 2}), {}) == {0: (3, 10), 1: (0, 2),
                                                                                         2: (0, 0)}
    assert partition_ranges(ends, Offsets(None, {0: 3}), Offsets(), {0: 6, 1: 1}) == {0: (6, 10), 1: (1, 4),
                                                                                      2: (0, 0)}
    assert partition_ranges(ends, Offsets(20), Offsets(), {}) == {0: (10, 10), 1: (4, 4), 2: (0, 0)}  # past the end
    with pytest.raises(RescoreError, match="--until-offset: partition 3 does not exist"):
        partition_ranges(ends, Offsets(), Offsets(None, {3: 1}), {})
