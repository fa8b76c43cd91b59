"""When a batch's decode loop may stop before its long tail (producer.oversample / abort_after_s): the pure rule
against hand-worked cases, and the config refusing it where no decode loop can stop it."""

from __future__ import annotations

import pytest

from producers.config import ProducerConfig
from producers.step import should_stop


def test_oversample_stops_once_the_groups_a_version_needs_are_in():
    # B = 6, oversample 0.5: ceil(6 / 1.5) = 4 groups needed
    assert not should_stop([True, True, True, False, False, False], (), 0.5, 0.0, None)
    assert should_stop([True, True, True, True, False, False], (), 0.5, 0.0, None)
    # B = 5, oversample 1: ceil(5 / 2) = 3
    assert not should_stop([True, False, True, False, False], (), 1.0, 0.0, None)
    assert should_stop([True, False, True, True, False], (), 1.0, 0.0, None)


def test_abort_after_s_needs_the_time_and_one_complete_group():
    assert not should_stop([False, False, False], (), 0.0, 99.0, 5.0)  # nothing complete: keep going
    assert not should_stop([True, False, False], (), 0.0, 4.9, 5.0)
    assert should_stop([True, False, False], (), 0.0, 5.0, 5.0)
    assert not should_stop([True, False, False], (), 0.0, 99.0, None)  # neither rule on


def test_protected_groups_always_run_to_their_end_and_a_finished_batch_is_not_stopped():
    assert not should_stop([True, True, False, False], (2,), 1.0, 99.0, 1.0)  # group 2 was aborted before
    assert should_stop([True, True, True, False], (2,), 1.0, 0.0, None)
    assert not should_stop([True, True, True], (), 1.0, 99.0, 1.0)  # all ended: the loop ends by itself


def test_the_config_bounds_early_stop_and_refuses_it_for_multi_turn_episodes():
    assert ProducerConfig(oversample=0.5).oversample == 0.5 and ProducerConfig().abort_after_s is None
    with pytest.raises(ValueError, match="oversample"):
        ProducerConfig(oversample=-0.1)
    assert ProducerConfig(engine="vllm", oversample=0.25).oversample == 0.25  # its stepped requests stop too
    assert ProducerConfig(engine="server", abort_after_s=2.0).abort_after_s == 2.0  # its requests are aborted
    with pytest.raises(ValueError, match=r"producer.abort_after_s does not apply to multi-turn"):
        ProducerConfig(abort_after_s=3.0, environment="stream_rl.demo.retry:RetryAddition")
