"""The benchmark suite stays alive: its quick code path runs on tiny sizes against the real broker and produces every
figure, finite and positive. Nothing here asserts a speed (figures from a tiny run on a shared machine mean nothing).
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from bench import common, run as bench_run

TRANSPORT_FIGURES = {
    "record_bytes", "plain_msgpack_bytes", "codec_us", "plain_msgpack_us", "codec_ratio",
    "project_capacity_tokens_s", "produce_ratio", "consume_ratio", "capacity_ratio",
    *(f"{path}_{phase}_{unit}" for path in ("project", "raw") for phase in ("produce", "consume", "capacity")
      for unit in ("rollouts_s", "mb_s")),
}
WEIGHTS_FIGURES = {
    *(f"0.25MB.{mode}_{part}" for mode in ("inline", "store") for part in ("s", "publish_s", "fetch_s", "vs_disk",
                                                                          "mb_s")),
    "0.25MB.disk_s", "0.25MB.disk_save_s", "0.25MB.disk_load_s", "0.25MB.disk_mb_s",
}


@pytest.mark.broker
def test_tiny_run_produces_every_figure_and_regenerates_the_report(broker, tmp_path):
    json_path, md_path = tmp_path / "results.json", tmp_path / "benchmarks.md"
    code = bench_run.main(["transport", "weights", "--tiny", "--bootstrap", broker.bootstrap,
                           "--json", str(json_path), "--out", str(md_path)])
    assert code == 0
    results = json.loads(json_path.read_text())["benchmarks"]
    assert set(results) == {"transport", "weights"}
    for name, expected in (("transport", TRANSPORT_FIGURES), ("weights", WEIGHTS_FIGURES)):
        figures = results[name]["figures"]
        assert expected <= set(figures), expected - set(figures)
        assert all(math.isfinite(v) and v > 0 for v in figures.values()), figures
        assert all(len(values) == 3 for values in results[name]["samples"].values())
        assert results[name]["mode"] == "tiny" and results[name]["machine"]["broker"].startswith("tansu")
    doc = md_path.read_text()
    for number, title in ((1, "Transport capacity"), (4, "Weight broadcast")):
        assert f"## {number}. {title}" in doc
    assert doc.count("**Not yet measured** (not implemented yet)") == 4
    assert "## GPU" in doc and "**Reading.**" in doc
    again = tmp_path / "again.md"
    assert bench_run.main(["--render", "--json", str(json_path), "--out", str(again)]) == 0
    assert again.read_text() == doc


def test_unknown_or_unimplemented_names_and_too_few_repeats_exit_2(capsys):
    assert bench_run.main(["transport", "nosuch"]) == 2
    assert "unknown benchmark(s): nosuch" in capsys.readouterr().err
    assert bench_run.main(["pipeline"]) == 2
    assert "not implemented yet: pipeline" in capsys.readouterr().err
    assert bench_run.main(["weights", "--repeats", "2"]) == 2


def test_default_selection_is_every_implemented_benchmark_in_order():
    assert [s.name for s in bench_run.select([])] == ["transport", "weights"]
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
    doc = common.render_doc({"benchmarks": {}}, bench_run.BENCHMARKS)
    assert doc.count("**Not yet measured**") == 6
    assert "No GPU was available" in doc


def test_cli_bench_refuses_an_unknown_name_with_exit_2():
    from stream_rl.cli.main import app

    result = CliRunner().invoke(app, ["bench", "nosuch"])
    assert result.exit_code == 2
