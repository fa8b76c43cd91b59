"""bench/long_tail.py: the trainer-wait replay against hand-computed waits, and the benchmark alive at tiny size
(the figures mean nothing there, only that every one exists and is positive)."""

from __future__ import annotations

import pytest

from bench.long_tail import trainer_waits


def test_trainer_waits_by_hand():
    # k = 2 groups per step, steps of 1 s; published at 0.5, 3, 1, 4 (unsorted: sorted is 0.5, 1, 3, 4)
    # step 0: ready 1.0, t 0 -> wait 1.0, t = 2.0; step 1: ready 4.0 -> wait 2.0, t = 5.0
    assert trainer_waits([0.5, 3.0, 1.0, 4.0], 2, 1.0) == [1.0, 2.0]
    # everything published at once (the barrier at 4 s): the first step waits 4 s, the second none
    assert trainer_waits([4.0] * 4, 2, 1.0) == [4.0, 0.0]
    # a trainer slower than the groups arrive never waits after the first step
    assert trainer_waits([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 2, 5.0) == pytest.approx([0.2, 0.0, 0.0])
    assert trainer_waits([1.0, 2.0, 3.0], 2, 0.0) == [2.0]  # only whole steps count


def test_the_long_tail_benchmark_runs_tiny_and_reports_every_figure(tmp_path):
    import torch

    from bench import long_tail
    from bench.common import BenchContext, bad_figures

    threads = torch.get_num_threads()
    result = long_tail.run(BenchContext(bootstrap="unused", mode="tiny", workdir=tmp_path))
    assert torch.get_num_threads() == threads
    names = {f"{m}_{k}" for m in long_tail.MODES for k in ("publish_delay_s", "trainer_wait_s", "first_wait_s",
                                                             "batch_s")}
    assert set(result["figures"]) == names | {"train_step_s", "publish_delay_ratio", "trainer_wait_ratio"}
    assert bad_figures(result["figures"]) == []
    headers, rows = long_tail.table(result)
    assert len(rows) == 3 and all(len(row) == len(headers) for row in rows)
    lengths = result["params"]["response_lengths"]  # the reading is prose in docs/benchmarks.md; its numbers:
    assert "sooner" in long_tail.headline(result)
    assert f"| response tokens | {lengths['min']}-{lengths['max']} " in long_tail.more_tables(result)
