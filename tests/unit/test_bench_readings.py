"""The benchmark readings are prose written by hand in docs/benchmarks.md between markers: a regeneration keeps them,
flags one written for another run, and the modules that moved theirs keep only tables and numbers."""

from __future__ import annotations

import importlib

from bench import common
from bench import run as bench_run

MOVED = ("transport", "async", "weights", "offpolicy", "scorers", "ranks", "deltas", "packing", "rewards", "evalcost",
         "longtail", "servers")
"""Benchmarks whose reading is written by hand in docs/benchmarks.md (moved there from an f-string in their module,
or written there from the start)."""


def _result(at: str) -> dict:
    return {"measured_at": at, "figures": {}}


def test_a_kept_reading_round_trips_and_is_flagged_when_written_for_another_run():
    block = common.kept_reading("weights", _result("2026-01-01 00:00 UTC"),
                                ("2026-01-01 00:00 UTC", "**Reading.** Store mode\n\nwins | twice."))
    assert "written for the run of" in block and not block.startswith("*The reading below")
    assert common.readings_of("intro\n" + block + "\n## next") == {
        "weights": ("2026-01-01 00:00 UTC", "**Reading.** Store mode\n\nwins | twice.")}
    newer = common.kept_reading("weights", _result("2026-02-02 00:00 UTC"),
                                common.readings_of(block)["weights"])
    assert newer.startswith("*The reading below was written for the run of 2026-01-01 00:00 UTC; the figures "
                            "above are from 2026-02-02 00:00 UTC")
    assert common.readings_of(newer) == common.readings_of(block)  # the warning stays outside the kept text
    empty = common.kept_reading("ranks", _result("x"), None)
    assert common.readings_of(empty) == {"ranks": ("x", "**Reading.** Not written yet.")}


def test_moved_modules_have_no_reading_code_and_the_document_holds_theirs():
    kept = common.readings_of(common.READINGS_DOC.read_text())
    for name in MOVED:
        module = importlib.import_module(bench_run.BY_NAME[name].module)
        assert not hasattr(module, "reading"), name
        assert kept[name][1].startswith("**Reading.** ") and "Not written yet" not in kept[name][1], name


def test_regenerating_the_committed_results_keeps_every_written_reading(tmp_path):
    results = common.load_results(bench_run.DEFAULT_JSON)
    doc = common.render_doc(results, bench_run.report_specs(results))
    kept = common.readings_of(common.READINGS_DOC.read_text())
    assert {k: v for k, v in common.readings_of(doc).items() if k in kept} == kept
    for name in MOVED:  # written for the committed figures: no warning
        assert f"*The reading below was written for the run of {kept[name][0]}" not in doc
    elsewhere = tmp_path / "none.md"
    bare = common.render_doc(results, bench_run.report_specs(results), readings_from=elsewhere)
    assert bare.count("**Reading.** Not written yet.") == len(MOVED)
    # the modules that still write theirs in code (pipeline, TRL: the lead's) are untouched
    still = [s.name for s in bench_run.BENCHMARKS + bench_run.NAMED_ONLY
             if s.module and hasattr(importlib.import_module(s.module), "reading")]
    assert set(still) | set(MOVED) == {s.name for s in bench_run.BENCHMARKS + bench_run.NAMED_ONLY if s.module}
