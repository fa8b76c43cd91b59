"""The benchmark suite stays alive: its quick code path runs on tiny sizes against the real broker and produces every
figure, finite and positive. Nothing here asserts a speed (figures from a tiny run on a shared machine mean nothing).
"""

from __future__ import annotations

import json
import math

import pytest

from bench import common
from bench import run as bench_run

TRANSPORT_FIGURES = {
    "record_bytes", "plain_msgpack_bytes", "codec_us", "plain_msgpack_us", "codec_ratio",
    "project_capacity_tokens_s", "produce_ratio", "consume_ratio", "capacity_ratio",
    *(f"{path}_{phase}_{unit}" for path in ("project", "raw", "durable")
      for phase in ("produce", "consume", "capacity") for unit in ("rollouts_s", "mb_s")),
    *(f"durable_{phase}_ratio" for phase in ("produce", "consume", "capacity")),
}
WEIGHTS_FIGURES = {
    *(f"0.25MB.{mode}_{part}" for mode in ("inline", "store") for part in ("s", "publish_s", "fetch_s", "vs_disk",
                                                                          "mb_s")),
    "0.25MB.disk_s", "0.25MB.disk_save_s", "0.25MB.disk_load_s", "0.25MB.disk_mb_s", "0.25MB.fsync_s",
    "0.25MB.sha256_pass_s",
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
    pending = [spec for spec in bench_run.BENCHMARKS if spec.module is None]
    assert doc.count("**Not yet measured** (not implemented yet)") == len(pending)
    assert doc.count("**Not yet measured** (not run yet)") == len(bench_run.BENCHMARKS) - 2 - len(pending)
    assert "## GPU" in doc and "**Reading.**" in doc
    again = tmp_path / "again.md"
    assert bench_run.main(["--render", "--json", str(json_path), "--out", str(again)]) == 0
    assert again.read_text() == doc


GPU_SCRIPT_WITHOUT_SERVICES = """
import runpy, sys
for name in ("pydantic", "pydantic_core", "kafka", "opentelemetry", "typer"):
    sys.modules[name] = None  # the GPU machine has none of these: importing one must fail
sys.argv = ["bench.gpu", *sys.argv[1:]]
runpy.run_module("bench.gpu", run_name="__main__")
"""


def test_gpu_script_runs_tiny_on_cpu_without_pydantic_or_kafka_and_renders(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "gpu"
    proc = subprocess.run([sys.executable, "-c", GPU_SCRIPT_WITHOUT_SERVICES, "--device", "cpu", "--tiny",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "gpu_results.json").read_text())
    assert json.loads(proc.stdout) == result
    figures = result["figures"]
    expected = {"gen_tokens_s", "gen_s", "train_tokens_s", "train_step_s", "store_s", "store_publish_s",
                "store_fetch_s", "memory_s", "disk_s", "store_vs_disk", "weights_mb"}
    assert expected <= set(figures), expected - set(figures)
    assert not common.bad_figures(figures), figures
    assert all(len(values) == 3 for values in result["samples"].values())
    assert 0 < figures["gen_tokens"] <= 4 * 8  # 4 prompts x at most 8 new tokens
    samples = result["samples"]
    assert samples["store_s"] == pytest.approx([a + b for a, b in zip(samples["store_publish_s"],
                                                                       samples["store_fetch_s"])])
    assert result["device"]["device"] == "cpu" and result["params"]["mode"] == "tiny"
    doc = common.render_doc({"benchmarks": {}}, bench_run.BENCHMARKS, gpu_json=out / "gpu_results.json")
    gpu_part = doc[doc.index("## GPU"):]
    assert "No GPU was available" not in gpu_part and "tokens/s" in gpu_part and "CPU (" in gpu_part


PIPELINE_FIGURES = {
    *(f"{stage}_{unit}" for stage in ("generate", "score", "train", "train_always")
      for unit in ("tokens_s", "step_s")),
    "train_skip_proximal_speedup", "pipeline_tokens_s", "pipeline_step_s", "pipeline_trainer_busy", "pipeline_train_step_s", "pipeline_broadcast_s",
    "pipeline_trainer_work_s",
    "slowest_stage_tokens_s", "pipeline_vs_slowest", "pipeline_train_vs_alone",
}
ASYNC_FIGURES = {  # tiny mode: lock-step against max_lag 1 only (full: 1, 2 and 4)
    *(f"{v}_{part}" for v in ("lockstep", "lag1") for part in ("wall_s", "reward", "lag_mean")), "lag1_speedup",
    "generate_step_s", "score_step_s", "train_step_s", "stage_sum_over_max", "ideal_speedup",
}
SCORERS_FIGURES = {"scorers1_rollouts_s", "scorers2_rollouts_s", "scale_out", "prefill1_rollouts_s",
                   "prefill2_rollouts_s", "prefill_vs_one_scorer"}
RANKS_FIGURES = {"r1t1_tokens_s", "r1t2_tokens_s", "r2t1_tokens_s", "two_ranks_vs_one_thread",
                 "two_ranks_vs_two_threads", "allreduce_ms", "allreduce_mb_s", "model_vs_measured"}


@pytest.mark.broker
@pytest.mark.timeout(900)  # tiny: one round, 5 pipeline/scorer launches
def test_tiny_demo_benchmarks_produce_every_figure(broker, demo_build, tmp_path, monkeypatch):
    """Benchmarks 2, 3, 6 and 7 on the session's demo build: real role processes (7: real torchrun ranks), every
    figure finite and positive."""
    from bench import demo_runs

    monkeypatch.setenv(demo_runs.DEMO_DIR_ENV, str(demo_build[0]))
    json_path, md_path = tmp_path / "results.json", tmp_path / "benchmarks.md"
    code = bench_run.main(["pipeline", "async", "scorers", "ranks", "--tiny", "--bootstrap", broker.bootstrap,
                           "--json", str(json_path), "--out", str(md_path)])
    assert code == 0
    results = json.loads(json_path.read_text())["benchmarks"]
    for name, expected in (("pipeline", PIPELINE_FIGURES), ("async", ASYNC_FIGURES), ("scorers", SCORERS_FIGURES),
                           ("ranks", RANKS_FIGURES)):
        figures = results[name]["figures"]
        assert expected <= set(figures), expected - set(figures)
        assert all(math.isfinite(v) and v > 0 for v in figures.values()), figures
        assert all(len(values) == 1 for values in results[name]["samples"].values()), name  # tiny: one round
    assert results["async"]["params"]["stages_reused"] is True  # benchmark 2 ran first in the same invocation
    assert all(count == 0 for count in results["async"]["params"]["stale"]["lockstep"])
    doc = md_path.read_text()
    for number, title in ((2, "Pipeline efficiency"), (3, "Asynchronous vs synchronous"), (6, "Scorer scale-out"),
                          (7, "Trainer ranks")):
        assert f"## {number}. {title}" in doc
    assert "16 GPUs, 2 nodes" in doc  # the scaling model's extrapolation, from bench/gpu_results.json


def _tiny_in_process_run(name: str, demo_build, tmp_path, monkeypatch) -> tuple[dict, str]:
    """Run benchmark ``name`` in tiny mode on the session's demo build: (its results entry, the rendered report)."""
    monkeypatch.setenv("BENCH_DEMO_DIR", str(demo_build[0]))
    json_path, md_path = tmp_path / "results.json", tmp_path / "benchmarks.md"
    # in-process benchmark: it never contacts the broker, so an unused address is given instead of starting one
    assert bench_run.main([name, "--tiny", "--bootstrap", "127.0.0.1:9", "--json", str(json_path),
                           "--out", str(md_path)]) == 0
    return json.loads(json_path.read_text())["benchmarks"][name], md_path.read_text()


def test_offpolicy_tiny_run_produces_every_figure_and_paired_differences(demo_build, tmp_path, monkeypatch):
    from bench import offpolicy

    result, doc = _tiny_in_process_run("offpolicy", demo_build, tmp_path, monkeypatch)
    keys = [f"lag{lag}.{variant}" for lag, variant in offpolicy.runs(result["params"])]
    assert keys == ["lag0.decoupled", "lag2.decoupled", "lag2.uncorrected", "lag2.ppo_mu"]
    expected = {"start_reward"} | {f"{k}.{what}" for k in keys for what in ("final_reward", "train_reward_last")}
    assert set(result["figures"]) == expected
    for name, values in result["samples"].items():
        assert len(values) == 3 and all(0.0 <= v <= 1.0 for v in values)  # one per seed; rewards are 0/1 means
        assert result["figures"][name] == sorted(values)[1]
    assert result["diagnostics"]["lag0.decoupled"]["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # mu = pi_prox
    assert "## 5. Off-policy robustness" in doc and " correction on vs this |" in doc  # does the correction matter:
    assert f"| {offpolicy.verdict(offpolicy.paired_difference(result, 2, 'uncorrected'))} |" in doc  # per lag
    fake = {"samples": {"lag4.decoupled.final_reward": [0.5, 0.4, 0.3],
                        "lag4.uncorrected.final_reward": [0.25, 0.5, 0.2]}}
    assert offpolicy.paired_difference(fake, 4, "uncorrected") == pytest.approx((0.1, -0.1, 0.25))
    assert offpolicy.paired_difference(fake, 4, "ppo_mu") is None


def test_deltas_tiny_run_measures_real_steps_of_both_workloads(demo_build, tmp_path, monkeypatch):
    from bench import deltas
    from stream_rl.weights.delta import MAX_CHANGED_FRACTION
    from stream_rl.weights.publisher import MAX_DELTA_RATIO

    result, doc = _tiny_in_process_run("deltas", demo_build, tmp_path, monkeypatch)
    assert deltas.keys(result) == ["demo.float32", "demo.bfloat16", "qwen.bfloat16"]
    assert set(result["steps"]) == set(deltas.keys(result))
    assert result["workloads"]["qwen"]["parameters"] < 1_000_000  # tiny: the 2-layer model of the family
    for key, steps in result["steps"].items():
        assert [s["step"] for s in steps] == [1, 2], key
        for s in steps:
            usable = s["delta_bytes"] is not None and s["delta_bytes"] <= MAX_DELTA_RATIO * s["full_bytes"]
            assert s["sent_bytes"] == (s["delta_bytes"] if usable else s["full_bytes"]), (key, s)
            assert (s["delta_bytes"] is None) == (s["changed"] > MAX_CHANGED_FRACTION) == (s["rebuild_s"] is None)
            assert 0 < s["changed"] <= s["changed_elements"] <= 1, (key, s)
        assert result["figures"][f"{key}.sent_ratio"] == steps[1]["sent_bytes"] / steps[1]["full_bytes"]
        assert result["figures"][f"{key}.step1_changed"] == steps[0]["changed"]
    figures = result["figures"]
    assert figures["demo.float32.full_mb"] == pytest.approx(2 * figures["demo.bfloat16.full_mb"], rel=1e-3)
    # lr 1e-6 is far below the bf16 spacing of weights ~0.01: few elements change, the delta is what is sent
    assert figures["qwen.bfloat16.changed_elements"] < 0.2 and figures["qwen.bfloat16.sent_ratio"] < MAX_DELTA_RATIO
    assert figures["demo.float32.changed_elements"] > 0.5  # fp32 at lr 1e-4: the low bits of most elements move
    assert "## 8. Delta versions" in doc and "goal ≤ 5 %" in doc and deltas.headline(result) in doc
