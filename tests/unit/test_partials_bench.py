"""bench/partials.py alive at tiny size (the figures mean nothing there, only that every one exists, is positive and
that the kept share is a share)."""

from __future__ import annotations


def test_the_partials_benchmark_runs_tiny_and_reports_every_figure(tmp_path):
    import torch

    from bench import partials
    from bench.common import BenchContext, bad_figures

    threads = torch.get_num_threads()
    result = partials.run(BenchContext(bootstrap="unused", mode="tiny", workdir=tmp_path))
    assert torch.get_num_threads() == threads
    figures = result["figures"]
    assert not bad_figures(figures)
    assert 0 < figures["kept_share"] <= 1 and figures["prefix_tokens"] >= 1
    samples = result["samples"]  # per round: the kept share is prefix / (prefix + continuation)
    assert samples["kept_share"][0] == samples["prefix_tokens"][0] / (
        samples["prefix_tokens"][0] + samples["resume_new_tokens"][0])
    assert partials.headline(result) and partials.reading(result) and partials.table(result)[1]
