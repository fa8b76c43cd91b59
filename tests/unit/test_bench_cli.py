"""The benchmark harness without running a benchmark: name selection and exit codes, interleaved rounds, figure
checks, the report of what was not measured, and the pure windows and placements the benchmarks compute."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from bench import common
from bench import run as bench_run


def test_unknown_or_unimplemented_names_and_too_few_repeats_exit_2(capsys):
    assert bench_run.main(["transport", "nosuch"]) == 2
    assert "unknown benchmark(s): nosuch" in capsys.readouterr().err
    pending = [spec.name for spec in bench_run.BENCHMARKS if spec.module is None]
    if pending:  # once every benchmark is implemented there is no such name left to refuse
        assert bench_run.main([pending[0]]) == 2
        assert f"not implemented yet: {pending[0]}" in capsys.readouterr().err
    assert bench_run.main(["weights", "--repeats", "2"]) == 2


def test_default_selection_is_every_implemented_benchmark_in_order():
    implemented = [s.name for s in bench_run.BENCHMARKS if s.module is not None]
    assert {"transport", "pipeline", "async", "weights", "scorers", "ranks", "deltas"} <= set(implemented)
    assert [s.name for s in bench_run.select([])] == implemented
    assert [s.name for s in bench_run.select(["weights", "transport"])] == ["transport", "weights"]


def test_interleave_runs_variants_round_by_round_and_needs_three_rounds():
    order: list[str] = []
    steps = [(name, lambda name=name: order.append(name) or {f"{name}_s": len(order)}) for name in "ab"]
    samples = common.interleave(steps, 3)
    assert order == ["a", "b"] * 3
    assert samples == {"a_s": [1.0, 3.0, 5.0], "b_s": [2.0, 4.0, 6.0]}
    assert common.medians(samples) == {"a_s": 3.0, "b_s": 4.0}
    with pytest.raises(ValueError):
        common.interleave(steps, 2)


def test_bad_figures_names_non_finite_and_non_positive_values():
    assert common.bad_figures({"ok": 1.5, "nan": math.nan, "zero": 0.0, "neg": -1, "inf": math.inf}) == \
        ["nan", "zero", "neg", "inf"]


def test_report_without_results_lists_every_benchmark_as_not_measured():
    doc = common.render_doc({"benchmarks": {}}, bench_run.BENCHMARKS, gpu_json=None)
    assert doc.count("**Not yet measured**") == len(bench_run.BENCHMARKS)
    assert "No GPU was available" in doc


def test_bench_refuses_an_unknown_name_with_exit_2(capsys):
    assert bench_run.main(["nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err


def test_the_installed_cli_has_no_bench_command():
    """The benchmark suite sits above the product: the CLI never imports it (`make bench` runs it)."""
    from stream_rl.cli.main import app

    result = CliRunner().invoke(app, ["bench", "--help"])
    assert result.exit_code == 2 and "No such command" in result.output


def test_demo_run_window_counts_the_steps_after_the_skipped_ones():
    from bench.demo_runs import mean_of, window

    rows = [{"step": i + 1, "time": t, "batch/tokens": 100 * (i + 1), "batch/sequences": 256, "reward/mean": r}
            for i, (t, r) in enumerate([(10.0, 0.1), (12.0, 0.2), (15.0, 0.3), (19.0, 0.5)])]
    assert window(rows, skip=1, steps=2) == (5.0, 200 + 300, 512)  # end of step 1 (t=10) to end of step 3 (t=15)
    assert window(rows, skip=2, steps=2) == (7.0, 300 + 400, 512)
    assert mean_of(rows, "reward/mean", 2) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        window(rows, skip=2, steps=3)
    with pytest.raises(ValueError):
        window(rows, skip=0, steps=1)


def test_placement_gives_the_named_role_its_own_core():
    from bench.demo_runs import placement

    assert placement([0, 1], "score") == {"train": 1, "score": 0, "produce": 1}
    assert placement([2, 5, 7, 9], "train") == {"train": 2, "score": 5, "produce": 7}
    assert placement([3], "train") == {"train": 3, "score": 3, "produce": 3}


def test_scorer_window_rate_counts_only_while_every_scorer_works():
    from bench.scorers import window_rate

    # scorer a stamps at 0..10, scorer b at 2..8: the window is (2, 8]; a has 3..8 inside (6), b has 4, 6, 8 (3)
    stamps = {"a": [float(t) for t in range(11)], "b": [2.0, 4.0, 6.0, 8.0]}
    assert window_rate(stamps) == (9 / 6, 9, 6.0)
    assert window_rate({"a": [1.0, 2.0, 3.0, 5.0]}) == (3 / 4, 3, 4.0)
    with pytest.raises(ValueError):
        window_rate({"a": [0.0, 1.0], "b": [2.0, 3.0]})  # no overlap
    with pytest.raises(ValueError):
        window_rate({"a": [1.0]})


def test_deltas_measure_step_sends_the_delta_when_few_bytes_change_and_the_payload_when_most_do(monkeypatch):
    import numpy as np

    from bench import deltas
    from schemas import TensorEntry

    index = (TensorEntry(name="a", dtype="BF16", shape=(1024,), offset=0, nbytes=2048),
             TensorEntry(name="b", dtype="F32", shape=(512,), offset=2048, nbytes=2048))
    base = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    new = base.copy()
    new[[0, 1, 10, 2048, 2049, 4095]] ^= 1  # bf16 elements 0 and 5; f32 elements 0 and 511: 4 of 1536 elements
    step = deltas.measure_step(3, new, base, index)
    assert step.full_bytes == 4096 and step.changed == 6 / 4096 and step.changed_elements == 4 / 1536
    assert step.delta_bytes is not None and step.sent_bytes == step.delta_bytes < 4096 / 2
    assert step.rebuild_s is not None and step.rebuild_s >= 0
    everything = deltas.measure_step(4, ~base, base, index)  # every byte changed: no delta is even encoded
    assert everything.delta_bytes is None and everything.rebuild_s is None
    assert everything.sent_bytes == 4096 and everything.changed == 1.0 and everything.changed_elements == 1.0
    monkeypatch.setattr(deltas, "apply_delta", lambda version, prev, blob: prev.copy())  # a wrong rebuild
    with pytest.raises(RuntimeError, match="rebuilt from the delta is not"):
        deltas.measure_step(5, new, base, index)
