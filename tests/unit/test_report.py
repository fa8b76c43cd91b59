"""`stream-rl report`: PNGs, one self-contained HTML page and the health summary of a run's metrics.jsonl.

Where the rows come from: the plotting test writes rows produced by the trainer's own step functions
(`rollout_metrics` + `train_step` on a tiny Llama, wrapped as the trainer loop wraps them: `step`,
`policy_version`, `time`, the measured `time/step_s`, non-finite values as null). That is every metric key and
value the real loop writes except its batcher counters and broadcast/checkpoint timings, for about a second of CPU
and no broker; the full pipeline's run directory is reported on at the end of tests/e2e/test_pipeline_run.py. The summary
numbers are checked on hand-made rows whose expected values are computed by hand in the comments.
"""

from __future__ import annotations

import base64
import json
import math
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from stream_rl.cli.main import app
from stream_rl.operator_tools.report import Thresholds, format_summary, load_metrics, steps_of, summarize

torch.set_num_threads(1)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
runner = CliRunner()


def write_rows(path, rows, torn_tail: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows)
    path.write_text(text + ('{"step": 99, "reward/me' if torn_tail else ""))


@pytest.fixture(scope="module")
def trainer_rows():
    """Four steps of the real trainer step on a tiny model, as metrics.jsonl rows."""
    from support.trainer import random_group, tiny_policy, trainer_cfg

    from consumers.trainer.engines import TorchEngine, TrainModule
    from consumers.trainer.rollout_metrics import rollout_metrics
    from consumers.trainer.tensors import build_batch
    from consumers.trainer.train_step import TrainState, train_step

    model, ref, cfg, state = tiny_policy(seed=0), tiny_policy(seed=1), trainer_cfg(lr=1e-2), TrainState()
    engine, rng, rows = TorchEngine(TrainModule(model), cfg), np.random.default_rng(0), []
    for step in range(4):
        items = [s for p in range(2) for s in random_group(model, p, rng=rng, version=max(0, step - 1),
                                                           ref_model=ref)]
        started = time.monotonic()
        metrics = rollout_metrics(items, state.version, cfg.success_threshold)
        metrics.update(train_step(engine, build_batch(items), cfg, state))
        state.version += 1
        metrics["time/step_s"] = time.monotonic() - started
        rows.append({"step": state.step, "policy_version": state.version, "time": time.time(),
                     **{k: (v if math.isfinite(v) else None) for k, v in sorted(metrics.items())}})
    return rows


def test_report_writes_png_plots_and_a_self_contained_html_page(tmp_path, trainer_rows):
    run_dir = tmp_path / "run"
    write_rows(run_dir / "metrics.jsonl", trainer_rows)
    result = runner.invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    out = run_dir / "report"
    pngs = sorted(out.glob("*.png"))
    stems = {p.stem for p in pngs}
    assert stems == {"overview", "reward", "success", "kl", "entropy", "loss", "clipfrac", "response_length",
                     "staleness", "mismatch", "timings", "throughput"}
    for png in pngs:
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1024, png
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(pngs)
    for png in pngs:
        assert base64.b64encode(png.read_bytes()).decode() in page
    assert "<script" not in page and 'src="http' not in page and "<link" not in page
    summary = (out / "summary.txt").read_text()
    assert "steps: 4 (step 1 .. 4)" in summary and summary in result.stdout
    assert "report.html" in result.stdout


def test_missing_metrics_are_skipped_and_nulls_leave_gaps(tmp_path):
    rows = [{"step": i, "reward/mean": None if i == 3 else 0.1 * i} for i in range(1, 6)]
    write_rows(tmp_path / "metrics.jsonl", rows)
    result = runner.invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["overview.png", "reward.png"]
    assert (tmp_path / "out" / "report.html").read_text().count("data:image/png;base64,") == 2
    assert "max KL to reference (kl/ref_mean): n/a" in result.stdout


@pytest.mark.parametrize("content", [None, "", "\n", "not json\n"])
def test_a_missing_or_empty_metrics_file_exits_2(tmp_path, content):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "metrics" in result.output and str(tmp_path) in result.output
    assert not (tmp_path / "report").exists()


def hand_rows() -> list[dict]:
    """20 steps. first 10% = steps 1-2, last 10% = steps 19-20 (k = 20 // 10 = 2)."""
    rows = []
    for step in range(1, 21):
        rows.append({
            "step": step,
            "reward/mean": {1: 0.6, 2: 0.4, 19: 0.2, 20: 0.1}.get(step, 0.3),  # first 0.5, last 0.15: -0.35
            "kl/ref_mean": 1.5 if step == 7 else 0.1,  # max 1.5 at step 7
            "loss/total": None if step in (5, 9) else 0.01,  # two non-finite losses (written as null)
            "optim/grad_norm": 1.0,
            "optim/skipped_updates": 1.0 if step in (5, 9) else 0.0,
            "optim/skipped_updates_total": float((step >= 5) + (step >= 9)),  # 2 at the end
            "staleness/max_lag": 3.0 if step == 11 else 1.0,  # max 3
            "mismatch/logp_abs_diff": 0.01 if step <= 10 else 0.03,  # mean 0.02
            "policy/entropy": 0.5,
            "time/step_s": 2.0, "time/wait_s": 0.5,
        })
    return rows


def test_summary_numbers_and_warnings_on_hand_made_rows():
    s = summarize(hand_rows())
    assert (s.steps, s.first_step, s.last_step) == (20, 1, 20)
    assert s.reward_first == pytest.approx(0.5) and s.reward_last == pytest.approx(0.15)
    assert s.reward_change == pytest.approx(-0.35)
    assert (s.kl_max, s.kl_max_step) == (1.5, 7)
    assert s.skipped_updates == 2 and s.non_finite_rows == 2
    assert s.max_lag == 3.0 and s.mismatch_mean == pytest.approx(0.02)
    assert s.step_s_mean == 2.0 and s.wait_s_mean == 0.5
    text = format_summary(s, "r1")
    assert "reward/mean: first 10% 0.5, last 10% 0.15, change -0.35" in text
    assert "max KL to reference (kl/ref_mean): 1.5 at step 7" in text
    assert "skipped updates: 2" in text and "max staleness lag (versions): 3" in text
    assert any(w.startswith("KL to the reference above 1") for w in s.warnings)
    assert "2 skipped updates (NaN/Inf loss or gradient norm)" in s.warnings
    assert "2 steps with a NaN/Inf loss or gradient norm" in s.warnings
    assert any(w.startswith("reward fell by 0.35") for w in s.warnings)
    assert not any("mismatch" in w or "entropy" in w for w in s.warnings)


def test_thresholds_and_healthy_rows():
    rows = [{"step": i, "reward/mean": 0.1 * i, "kl/ref_mean": 0.2, "mismatch/logp_abs_diff": 0.05,
             "policy/entropy": 1.0} for i in range(1, 11)]
    assert summarize(rows).warnings == []
    assert "warnings: none" in format_summary(summarize(rows))
    strict = summarize(rows, th=Thresholds(kl_max=0.1, mismatch_max=0.01))
    assert len(strict.warnings) == 2 and "logprob mismatch mean 0.05 above 0.01" in strict.warnings[1]
    for i, row in enumerate(rows):  # entropy 1.0 -> 0.1: the last 10% is under 0.2 x the first 10%
        row["policy/entropy"] = 1.0 if i == 0 else 0.1
    assert any(w.startswith("entropy collapsed") for w in summarize(rows).warnings)


def test_a_torn_last_line_is_skipped_and_reported(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", hand_rows(), torn_tail=True)
    rows, bad = load_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 20 and bad == 1
    assert "1 unreadable lines in metrics.jsonl were skipped" in summarize(rows, bad).warnings


# ---------------------------------------------------------------- issue 13: alerts, times, panels, data coverage


def write_alerts(run_dir, *alerts) -> None:
    from stream_rl.alerts.monitor import alert_log_path

    path = alert_log_path(run_dir, alerts[0]["instance_id"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(a) + "\n" for a in alerts))


def alert(name, state, action, t, message="x", role="trainer", instance_id="trainer-1a2b3c4d"):
    return {"name": name, "state": state, "action": action, "role": role, "instance_id": instance_id,
            "message": message, "value": None, "threshold": None, "created_at": t}


def test_report_names_the_alert_that_stopped_the_run(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [{"step": i, "reward/mean": 0.5, "time/step_s": 2.0,
                                              "time/wait_s": 0.5} for i in range(1, 6)])
    write_alerts(tmp_path, alert("consumer_lag", "firing", "log", 10.0, "lag/position_total = 2000 records"),
                 alert("consumer_lag", "resolved", "log", 20.0),
                 alert("consumer_lag", "firing", "log", 30.0, "lag/position_total = 3000 records"),
                 alert("loss_nonfinite", "firing", "stop", 40.0, "loss/total is nan (not finite)"))
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "warnings: none" not in out and "alerts: none" not in out
    assert ("  - loss_nonfinite (action stop) on trainer trainer-1a2b3c4d, still firing at the end: loss/total is "
            "nan (not finite)") in out
    assert ("  - consumer_lag (action log) on trainer trainer-1a2b3c4d, 2 times, still firing at the end: "
            "lag/position_total = 2000 records") in out
    assert "  - stopped by alert loss_nonfinite on trainer trainer-1a2b3c4d: loss/total is nan" in out
    assert "2 alert(s) fired: consumer_lag, loss_nonfinite" in out


def test_report_reads_alert_lines_from_role_logs_without_alert_files(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [{"step": 1, "reward/mean": 0.5}])
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer-0.log").write_text(
        "2026-01-01 10:00:00 WARNING stream_rl.alerts.monitor alert kl_ref_high firing (action log) on trainer "
        "trainer-1a2b3c4d: kl/ref_mean = 1.5 > 1\nother line\n")
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "kl_ref_high (action log) on trainer trainer-1a2b3c4d, still firing at the end: kl/ref_mean = 1.5 > 1" \
        in result.stdout
    assert "warnings: none" not in result.stdout


def test_step_time_and_wait_are_separate_figures():
    text = format_summary(summarize(hand_rows()))  # time/step_s 2.0, time/wait_s 0.5 on every row
    assert "mean step time (time/step_s: train + broadcast of one step): 2.000 s" in text
    assert "mean wait for data before a step (time/wait_s, not part of the step time): 0.500 s" in text
    assert "mean step cycle (wait + step): 2.500 s, 20% of it waiting" in text
    assert "(waiting for data" not in text


def test_a_binary_reward_does_not_hide_the_mean_under_the_success_rate(tmp_path):
    from stream_rl.operator_tools.report import _draw, _figure, write_plots

    rows = [{"step": i, "reward/mean": float(i % 2), "reward/group_success_rate": float(i % 2)}
            for i in range(1, 6)]
    titles = [t for t, _ in write_plots(rows, tmp_path)]
    assert "Reward (mean)" in titles and "Group success rate" in titles  # a panel each
    ax = _figure(4, 3).add_subplot()
    _draw(ax, steps_of(rows), rows, ["reward/mean", "reward/group_success_rate"], "both")
    assert len({line.get_linestyle() for line in ax.get_lines()}) == 2  # distinct styles where they overlap
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["reward/mean", "reward/group_success_rate"]


def test_epoch_and_distinct_prompts_are_shown(tmp_path):
    rows = [{"step": i, "reward/mean": 0.5, "data/epoch": float(i >= 4),
             "data/distinct_prompts": float(min(i, 3) * 10)} for i in range(1, 7)]
    write_rows(tmp_path / "metrics.jsonl", rows)
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "epochs trained: 2 (highest data/epoch 1, 0-based)" in result.stdout
    assert "distinct prompts trained at least once (data/distinct_prompts): 30" in result.stdout
    assert {"epoch.png", "distinct_prompts.png"} <= {p.name for p in (tmp_path / "report").glob("*.png")}
    write_rows(tmp_path / "metrics.jsonl", [{"step": 1, "reward/mean": 0.5}])
    without = runner.invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "o3")])
    assert "epochs trained" not in without.stdout and "distinct prompts" not in without.stdout
