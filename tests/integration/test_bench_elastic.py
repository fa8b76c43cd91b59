"""Benchmark 14 (elastic cores) stays alive: its tiny code path runs `stream-rl run` with each placement on its own
durable local broker, samples the CPU of the run's processes, and produces every figure and its report section.
Nothing here asserts a speed (a tiny run on a shared machine means nothing)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from bench import elastic
from bench import run as bench_run


def test_process_groups_and_cpu_seconds_of_a_real_process(tmp_path):
    assert elastic.group_of("python -m stream_rl.cli.main train --config c --instance 0") == "train"
    assert elastic.group_of("python -m stream_rl.cli.main produce --config c") == "produce"
    assert elastic.group_of("python -m stream_rl.cli.main run -c configs/demo.toml") == "supervisor"
    assert elastic.group_of("/usr/bin/tansu broker --storage-engine s3://x") == "broker"
    burn = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                             "while time.process_time() - t < 0.6: pass"])
    with elastic.CpuSampler(burn.pid, period_s=0.05) as sampler:
        burn.wait()
    spent = sampler.series[-1][1]["broker"]  # a process that ended keeps its last sample
    assert 0.3 <= spent <= 2.0, spent
    first, last = sampler.series[0][0], sampler.series[-1][0]
    assert sampler.between(first, last)["broker"] == pytest.approx(spent - sampler.series[0][1].get("broker", 0.0))


@pytest.mark.slow
@pytest.mark.timeout(900)  # tiny: one round, three `stream-rl run` launches
def test_tiny_elastic_benchmark_produces_every_figure_and_its_section(demo_build, tmp_path, monkeypatch):
    from bench import demo_runs

    monkeypatch.setenv(demo_runs.DEMO_DIR_ENV, str(demo_build[0]))
    json_path, md_path = tmp_path / "results.json", tmp_path / "benchmarks.md"
    assert bench_run.main(["elastic", "--tiny", "--json", str(json_path), "--out", str(md_path)]) == 0
    result = json.loads(json_path.read_text())["benchmarks"]["elastic"]
    figures = result["figures"]
    for variant in elastic.VARIANTS:
        for name in ("steps_per_s", "cpu_s_per_step", "cpu.train", "cpu.produce", "cpu.score", "cpu.broker"):
            assert f"{variant}.{name}" in figures, f"{variant}.{name}"
    assert all(math.isfinite(v) and v > 0 for v in figures.values()), figures
    assert figures["elastic_over_auto"] == pytest.approx(figures["elastic.steps_per_s"] / figures["auto.steps_per_s"])
    parts = sum(figures.get(f"auto.cpu.{g}", 0.0) for g in elastic.GROUPS)
    assert parts == pytest.approx(figures["auto.cpu_s_per_step"], rel=1e-6)  # one round: the median is the run
    assert len(result["samples"]["elastic.wide_steps"]) == 1  # the trainer reported placement/wide_phases
    doc = md_path.read_text()
    assert "## 14. Elastic cores" in doc and "| elastic |" in doc and "| auto |" in doc
