"""``stream-rl report``: plots, one self-contained HTML page and a health summary of a run's ``metrics.jsonl``.

Consumes: ``RUN_DIR/metrics.jsonl`` as the trainer writes it: one JSON object per step with ``step``,
``policy_version``, ``time`` and namespaced floats (``reward/mean``, ``kl/ref_mean``, ``time/update_s``,
``data/epoch``, ``data/distinct_prompts``, ...), non-finite values written as ``null``; and the alerts the run's
processes recorded (``RUN_DIR/alerts/*.jsonl``, else the alert lines of ``RUN_DIR/logs/*.log``;
:func:`stream_rl.alerts.read.run_alerts`).
Produces, in the output directory: one PNG per panel group (:data:`PANELS`) that has data, ``overview.png`` (the
first available series of every panel on one grid), ``report.html`` (every PNG embedded as a base64 data URI, no
external resource, no script) and ``summary.txt`` (what :func:`format_summary` prints).
Guarantees:
- A metric that a run does not have is skipped, and so is a panel none of whose metrics are present; a value
  that is null, NaN or infinite leaves a gap in its line and never enters a summary number.
- An unreadable line (a crash can tear the last one) is skipped and counted in the summary.
- A missing or empty metrics file raises :class:`ReportError`; nothing is written then.
- Only numbers from the metrics file and the alerts' rule names and numeric messages reach the outputs: no
  prompt or response text exists in either.
- Every alert the run raised is named in the summary (rule, action, role, instance, how often, its message) and
  is a warning; an alert with action ``stop`` is reported as what stopped the run. ``warnings: none`` means no
  alert fired and no threshold was crossed.
- The step time (``time/step_s``: train, settle and broadcast of one step) and the wait for data before it
  (``time/wait_s``, not part of the step time) are separate figures; a step cycle is their sum.
- Series that can coincide get panels of their own (a 0/1 reward makes ``reward/mean`` equal
  ``reward/group_success_rate``), and every line in a panel has its own line style and a legend entry.
- Plots are drawn on ``matplotlib.figure.Figure`` objects with the Agg canvas (no pyplot state, no display).
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from schemas import Alert
from stream_rl.alerts.read import open_alerts, run_alerts

# (file stem, title, fnmatch patterns over metric names in legend order; the first match is the overview's)
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward", "Reward (mean)", ("reward/mean",)),
    ("success", "Group success rate", ("reward/group_success_rate",)),
    ("kl", "KL", ("kl/ref_mean", "policy/approx_kl")),
    ("entropy", "Policy entropy", ("policy/entropy",)),
    ("loss", "Loss", ("loss/total", "loss/*")),
    ("clipfrac", "Clip fraction", ("policy/clipfrac", "policy/is_clipped_frac")),
    ("response_length", "Response length (tokens)", ("response/length_mean", "response/length_max")),
    ("staleness", "Staleness (policy versions behind)", ("staleness/mean_lag", "staleness/max_lag")),
    ("mismatch", "Sampler/trainer logprob mismatch", ("mismatch/logp_abs_diff", "mismatch/kl_mu_prox")),
    ("timings", "Stage timings (s)", ("time/step_s", "time/*_s", "time/*_s_mean")),
    ("throughput", "Throughput (tokens/s)", ("throughput/train_tokens_per_s", "throughput/*")),
    ("epoch", "Epoch (highest trained, 0-based)", ("data/epoch",)),
    ("distinct_prompts", "Distinct prompts trained", ("data/distinct_prompts",)),
    ("evaluation", "Held-out evaluation (RUN_DIR/evals.jsonl) beside the training reward",
     ("eval/*/greedy/accuracy", "eval/*/pass@*", "eval/*/maj@*", "eval/*/mean@*", "reward/mean")),
)
LINE_STYLES = ("-", "--", ":", "-.")


class ReportError(RuntimeError):
    """The run directory has no usable metrics; the message says what is missing."""


@dataclass(frozen=True)
class Thresholds:
    """When the summary warns (defaults fit the demo: its KL to the reference peaks near 0.75)."""

    kl_max: float = 1.0
    reward_drop: float = 0.05
    mismatch_max: float = 0.1
    entropy_floor: float = 0.2  # fraction of the first 10% mean entropy


@dataclass
class Summary:
    """The run's health in numbers (None: the run has no such metric)."""

    steps: int
    first_step: int | None
    last_step: int | None
    unreadable_lines: int = 0
    reward_first: float | None = None
    reward_last: float | None = None
    kl_max: float | None = None
    kl_max_step: int | None = None
    skipped_updates: int | None = None
    non_finite_rows: int = 0
    max_lag: float | None = None
    mismatch_mean: float | None = None
    step_s_mean: float | None = None
    wait_s_mean: float | None = None
    epoch_last: int | None = None
    distinct_prompts_last: int | None = None
    alerts: list[str] = field(default_factory=list)  # one line per (instance, rule) that fired
    stopped_by: str | None = None  # the alert with action stop that ended the run
    warnings: list[str] = field(default_factory=list)

    @property
    def reward_change(self) -> float | None:
        if self.reward_first is None or self.reward_last is None:
            return None
        return self.reward_last - self.reward_first


def load_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(rows, unreadable line count) from a metrics JSON-lines file; ReportError when missing or empty."""
    if not path.is_file():
        raise ReportError(f"no metrics file at {path}: is this a run directory the trainer wrote to?")
    rows, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    if not rows:
        raise ReportError(f"{path} has no metrics rows ({bad} unreadable lines): the trainer finished no step")
    return rows, bad


def _number(value: Any) -> float | None:
    """A finite float, or None for null, NaN, infinities, booleans and anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def steps_of(rows: Sequence[dict[str, Any]]) -> list[int]:
    """The x axis: each row's ``step``, else its 1-based position."""
    return [int(r["step"]) if _number(r.get("step")) is not None else i + 1 for i, r in enumerate(rows)]


def values(rows: Sequence[dict[str, Any]], key: str) -> list[float | None]:
    return [_number(r.get(key)) for r in rows]


def panel_keys(rows: Sequence[dict[str, Any]], patterns: Sequence[str]) -> list[str]:
    """Metric names matching ``patterns`` (in pattern order, then sorted) with at least one finite value."""
    names = sorted({k for r in rows for k in r})
    out: list[str] = []
    for pattern in patterns:
        out += [n for n in names if fnmatchcase(n, pattern) and n not in out
                and any(v is not None for v in values(rows, n))]
    return out


def _mean(xs: Sequence[float | None]) -> float | None:
    finite = [x for x in xs if x is not None]
    return sum(finite) / len(finite) if finite else None


def summarize(rows: Sequence[dict[str, Any]], unreadable: int = 0, th: Thresholds | None = None,
              alerts: Sequence[Alert] = ()) -> Summary:
    """Numbers over the whole run; the first and last 10% are ``max(1, n // 10)`` rows each; ``alerts``: the
    run's alert transitions, oldest first."""
    steps = steps_of(rows)
    k = max(1, len(rows) // 10)
    s = Summary(steps=len(rows), first_step=steps[0] if steps else None, last_step=steps[-1] if steps else None,
                unreadable_lines=unreadable)
    rewards = values(rows, "reward/mean")
    s.reward_first, s.reward_last = _mean(rewards[:k]), _mean(rewards[-k:])
    kl = [(v, step) for v, step in zip(values(rows, "kl/ref_mean"), steps) if v is not None]
    if kl:
        s.kl_max, s.kl_max_step = max(kl)
    s.skipped_updates = _skipped_updates(rows)
    s.non_finite_rows = sum(any(key in r and _number(r[key]) is None for key in ("loss/total", "optim/grad_norm"))
                            for r in rows)
    lags = [v for v in values(rows, "staleness/max_lag") if v is not None]
    s.max_lag = max(lags) if lags else None
    s.mismatch_mean = _mean(values(rows, "mismatch/logp_abs_diff"))
    s.step_s_mean, s.wait_s_mean = _mean(values(rows, "time/step_s")), _mean(values(rows, "time/wait_s"))
    s.epoch_last, s.distinct_prompts_last = _last_int(rows, "data/epoch"), _last_int(rows, "data/distinct_prompts")
    s.alerts, s.stopped_by = alert_lines(alerts)
    s.warnings = _warnings(s, rows, k, th or Thresholds())
    return s


def _last_int(rows: Sequence[dict[str, Any]], key: str) -> int | None:
    found = [v for v in values(rows, key) if v is not None]
    return int(found[-1]) if found else None


def alert_lines(alerts: Sequence[Alert]) -> tuple[list[str], str | None]:
    """(one line per (instance, rule) that fired: rule, action, role, instance, count, first message, whether
    it was still open at the end; the ``stop`` alert that ended the run, if one fired)."""
    fired: dict[tuple[str, str], list[Alert]] = {}
    for alert in alerts:
        if alert.state == "firing":
            fired.setdefault((alert.instance_id, alert.name), []).append(alert)
    still_open = {(a.instance_id, a.name) for a in open_alerts(alerts)}
    lines, stopped_by = [], None
    for key, firings in fired.items():
        first = firings[0]
        times = f", {len(firings)} times" if len(firings) > 1 else ""
        state = "still firing at the end" if key in still_open else "resolved"
        lines.append(f"{first.name} (action {first.action}) on {first.role} {first.instance_id}{times}, {state}: "
                     f"{first.message}")
        if first.action == "stop" and stopped_by is None:
            stopped_by = f"{first.name} on {first.role} {first.instance_id}: {first.message}"
    return lines, stopped_by


def _skipped_updates(rows: Sequence[dict[str, Any]]) -> int | None:
    """The trainer's running total when present (it survives resumes), else the sum of per-step counts."""
    totals = [v for v in values(rows, "optim/skipped_updates_total") if v is not None]
    if totals:
        return int(totals[-1])
    per_step = [v for v in values(rows, "optim/skipped_updates") if v is not None]
    return int(sum(per_step)) if per_step else None


def _warnings(s: Summary, rows: Sequence[dict[str, Any]], k: int, th: Thresholds) -> list[str]:
    out = [f"stopped by alert {s.stopped_by}"] if s.stopped_by else []
    if s.alerts:
        out.append(f"{len(s.alerts)} alert(s) fired: " + ", ".join(sorted({a.split(' ', 1)[0] for a in s.alerts}))
                   + " (see alerts above)")
    if s.kl_max is not None and s.kl_max > th.kl_max:
        out.append(f"KL to the reference above {th.kl_max:g}: max {s.kl_max:.4g} at step {s.kl_max_step}")
    if s.skipped_updates:
        out.append(f"{s.skipped_updates} skipped updates (NaN/Inf loss or gradient norm)")
    if s.non_finite_rows:
        out.append(f"{s.non_finite_rows} steps with a NaN/Inf loss or gradient norm")
    change = s.reward_change
    if change is not None and change < -th.reward_drop:
        out.append(f"reward fell by {-change:.4g} (first 10% mean {s.reward_first:.4g}, last 10% "
                   f"{s.reward_last:.4g})")
    if s.mismatch_mean is not None and s.mismatch_mean > th.mismatch_max:
        out.append(f"logprob mismatch mean {s.mismatch_mean:.4g} above {th.mismatch_max:g}: sampler and trainer "
                   "disagree (temperature, dtype or weights not synced)")
    entropy = values(rows, "policy/entropy")
    first, last = _mean(entropy[:k]), _mean(entropy[-k:])
    if first and last is not None and len(rows) >= 2 * k and last < th.entropy_floor * first:
        out.append(f"entropy collapsed: last 10% mean {last:.4g} is under {th.entropy_floor:g} x the first "
                   f"({first:.4g})")
    if s.unreadable_lines:
        out.append(f"{s.unreadable_lines} unreadable lines in metrics.jsonl were skipped")
    return out


def format_summary(s: Summary, name: str = "") -> str:
    """The summary as plain text lines (what ``stream-rl report`` prints and saves as summary.txt)."""
    def num(x: float | None, fmt: str = ".4g") -> str:
        return "n/a" if x is None else format(x, fmt)

    change = s.reward_change
    lines = [f"run {name}".rstrip(),
             f"steps: {s.steps} (step {s.first_step} .. {s.last_step})",
             f"reward/mean: first 10% {num(s.reward_first)}, last 10% {num(s.reward_last)}, change "
             f"{num(change, '+.4g')}",
             f"max KL to reference (kl/ref_mean): {num(s.kl_max)}"
             + (f" at step {s.kl_max_step}" if s.kl_max_step is not None else ""),
             f"skipped updates: {'n/a' if s.skipped_updates is None else s.skipped_updates}",
             f"max staleness lag (versions): {num(s.max_lag)}",
             f"mean logprob mismatch (mismatch/logp_abs_diff): {num(s.mismatch_mean)}"]
    lines += _data_lines(s) + _time_lines(s, num)
    lines += ["alerts:" if s.alerts else "alerts: none"] + [f"  - {a}" for a in s.alerts]
    lines.append("warnings:" if s.warnings else "warnings: none")
    return "\n".join(lines + [f"  - {w}" for w in s.warnings]) + "\n"


def _data_lines(s: Summary) -> list[str]:
    out = []
    if s.epoch_last is not None:
        out.append(f"epochs trained: {s.epoch_last + 1} (highest data/epoch {s.epoch_last}, 0-based)")
    if s.distinct_prompts_last is not None:
        out.append(f"distinct prompts trained at least once (data/distinct_prompts): {s.distinct_prompts_last}")
    return out


def _time_lines(s: Summary, num) -> list[str]:
    out = [f"mean step time (time/step_s: train + broadcast of one step): {num(s.step_s_mean, '.3f')} s",
           f"mean wait for data before a step (time/wait_s, not part of the step time): "
           f"{num(s.wait_s_mean, '.3f')} s"]
    if s.step_s_mean is not None and s.wait_s_mean is not None and s.step_s_mean + s.wait_s_mean > 0:
        cycle = s.step_s_mean + s.wait_s_mean
        out.append(f"mean step cycle (wait + step): {cycle:.3f} s, {s.wait_s_mean / cycle:.0%} of it waiting")
    return out


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _draw(ax, x: Sequence[int], rows: Sequence[dict[str, Any]], keys: Sequence[str], title: str) -> None:
    """One line per key; gaps where values are missing; a moving average over noisy long series."""
    import numpy as np

    for i, key in enumerate(keys):
        y = np.array([np.nan if v is None else v for v in values(rows, key)], dtype=float)
        few = np.count_nonzero(~np.isnan(y)) < 30
        style = LINE_STYLES[i % len(LINE_STYLES)]
        line, = ax.plot(x, y, marker="." if few else None, linewidth=1.0, alpha=1.0 if few else 0.35,
                        label=None if not few else key, linestyle=style)
        if not few:
            window = max(2, len(y) // 20)
            counts = np.convolve((~np.isnan(y)).astype(float), np.ones(window), "valid")
            smooth = np.convolve(np.nan_to_num(y), np.ones(window), "valid") / counts.clip(min=1)
            smooth[counts == 0] = np.nan
            ax.plot(x[window - 1:], smooth, color=line.get_color(), linewidth=1.6, linestyle=style,
                    label=f"{key} (avg {window})")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def write_plots(rows: Sequence[dict[str, Any]], out: Path) -> list[tuple[str, Path]]:
    """One PNG per panel with data, then overview.png; returns [(title, path)] with the overview first."""
    out.mkdir(parents=True, exist_ok=True)
    x = steps_of(rows)
    panels = [(stem, title, keys) for stem, title, patterns in PANELS if (keys := panel_keys(rows, patterns))
              and (stem != "evaluation" or keys[0].startswith("eval/"))]  # reward/mean alone is not an evaluation
    written = []
    for stem, title, keys in panels:
        fig = _figure(8, 4)
        _draw(fig.add_subplot(), x, rows, keys, title)
        fig.savefig(out / f"{stem}.png")
        written.append((title, out / f"{stem}.png"))
    if not panels:
        return written
    cols = 2
    fig = _figure(12, 3 * math.ceil(len(panels) / cols))
    for i, (_, title, keys) in enumerate(panels):
        _draw(fig.add_subplot(math.ceil(len(panels) / cols), cols, i + 1), x, rows, keys[:1], title)
    fig.savefig(out / "overview.png")
    return [("Overview", out / "overview.png")] + written


def write_html(plots: Sequence[tuple[str, Path]], summary_text: str, title: str, path: Path) -> Path:
    """A single page: the summary, then every plot inlined as a data URI (opens offline, no scripts)."""
    figures = "\n".join(
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(png.read_bytes()).decode("ascii")}"><figcaption>{html.escape(name)}</figcaption></figure>'
        for name, png in plots)
    page = (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>\n'
            "<style>body{font-family:sans-serif;margin:2em;max-width:1250px}pre{background:#f4f4f4;padding:1em}"
            "img{max-width:100%;border:1px solid #ddd}figure{margin:1.5em 0}</style></head><body>\n"
            f"<h1>{html.escape(title)}</h1>\n<pre>{html.escape(summary_text)}</pre>\n{figures}\n</body></html>\n")
    path.write_text(page, encoding="utf-8")
    return path


def build_report(run_dir: Path, out: Path | None = None, th: Thresholds | None = None) -> tuple[str, Path]:
    """Everything ``stream-rl report`` writes; returns (summary text, output directory)."""
    rows, unreadable = load_metrics(Path(run_dir) / "metrics.jsonl")
    out = Path(out) if out is not None else Path(run_dir) / "report"
    alerts, _ = run_alerts(run_dir)
    text = format_summary(summarize(rows, unreadable, th, alerts), Path(run_dir).name)
    from stream_rl.evaluation.ledger import FILE_NAME, read_rows
    from stream_rl.evaluation.report import with_evaluations

    evaluations = read_rows(Path(run_dir) / FILE_NAME)
    plots = write_plots(with_evaluations(rows, evaluations) if evaluations else rows, out)
    (out / "summary.txt").write_text(text)
    write_html(plots, text, f"stream-rl report: {Path(run_dir).name}", out / "report.html")
    return text, out
