"""Benchmark 9, against TRL: TRL's ``GRPOTrainer`` and ``stream-rl run`` on the same demo budget, side by side.

Consumes: the demo (:func:`bench.demo_runs.demo_dir`), ``configs/demo.toml``, the bench broker and ``trl`` (the
optional extra ``.[trl]``; without it :func:`run` raises at once, naming the install command).

Two workloads: **short** is the demo itself (its warm-started policy, 6 new tokens, its 180-step budget).
**long** is meant to make generation the larger stage, and raising ``max_new_tokens`` on the demo policy does not
do that: it ends every answer with ``<eos>`` within 4 tokens, so generation stops there whatever the cap
(measured). So **long** trains the demo's architecture freshly initialised (seed 0, no warm-start; :func:`untrained_policy`)
with a cap of 57 new tokens: it rarely samples ``<eos>``, so every batch generates up to the cap. It never answers
correctly, so its rewards are ~0 and its gradient ~0: **long** measures throughput only, and its rewards are kept
out of the figures (they are in ``params["rewards"]``).

Produces: per round (at least 3 in the full mode; the order of the two systems alternates, TRL first in odd rounds)
and per workload (:func:`workloads`), two processes run one after the other::

    trl      python -m bench.trl_worker ...        one process, synchronous, 2 torch threads (bench/trl_worker.py)
    stream   python -m stream_rl.cli.main run -c configs/demo.toml --set ...   the product command: producer,
             scorer and trainer processes (1 thread each) on the running bench broker

Each run's step rows give the time from the end of its first optimizer step to the end of its last (the figure
compared: it leaves out imports, model loading and the first generation of both), the trained samples per second
over that span and the reward curve; the whole command (process start to exit) is timed too. Figures are medians
over rounds; ``*.span_ratio`` and ``*.wall_ratio`` are stream-rl over TRL (below 1: stream-rl is faster).
In the full mode the reward curves of every round are drawn into ``docs/trl_peer.png``.

Guarantees: both systems train the same policy on the same prompts with the same verifier, group size, batch,
sampling and optimiser settings (:data:`bench.trl_worker.MATCHED`); what differs is listed by :func:`reading`.
A run that fails or trains fewer steps than asked raises with the tail of its logs; every child process is waited
for (``stream-rl run`` stops its own roles on exit).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench import demo_runs as dr
from bench import snapshots as snaps
from bench.common import BenchContext
from bench.delayed_reward import DELAY_ENV, DELAYED_REWARD
from bench.trl_reading import headline, plot, reading, table  # noqa: F401  (the report, kept apart)
from bench.trl_worker import stage_medians

DEMO_STEPS = 180  # configs/demo.toml trainer.max_steps: the demo's budget
LONG_TOKENS = 57  # the demo model has 64 positions and a prompt takes 7 (<bos> a b + c d =): the most that fits
TRL_THREADS = 2
SYSTEMS = ("trl", "stream")
PLOT = dr.ROOT / "docs" / "trl_peer.png"
LOG_TAIL = 3000


@dataclass(frozen=True)
class Workload:
    name: str
    max_new_tokens: int
    steps: int
    untrained: bool  # the demo architecture freshly initialised instead of the demo's warm-started policy
    what: str
    reward_delay_s: float = 0.0  # a slow reward service: every reward call waits this long (bench.delayed_reward)
    stream_sets: tuple[tuple[str, Any], ...] = ()  # stream-rl's own means for this workload (--set KEY=VALUE)
    seed: int = 0  # both systems' sampling (and TRL's data) seed; stream-rl's producer.seed and trainer.seed
    snapshot_every: int = 0  # keep the policy after every this many steps (Trace.snapshots); 0: none
    policy: Path | None = None  # another policy than the demo's (both systems); None: untrained or the demo's
    trl_reward: str = "demo"  # bench.trl_worker --reward: the TRL side's reward (stream-rl's: in stream_sets)


def workloads(ctx: BenchContext) -> list[Workload]:
    """short: the demo itself (its policy, 6 new tokens, its step budget); long: longer responses (see above)."""
    short, long = ctx.pick(full=(DEMO_STEPS, 24), quick=(8, 4), tiny=(3, 2))
    tokens = ctx.pick(full=LONG_TOKENS, quick=LONG_TOKENS, tiny=16)  # tiny: the test suite's, figures mean nothing
    return [Workload("short", 6, short, False, "the demo: warm-started policy, 6 new tokens"),
            Workload("long", tokens, long, True, f"untrained policy, up to {tokens} new tokens: longer "
                                                 "responses, throughput only")]


def policy_dir(ctx: BenchContext, demo: Path, w: Workload) -> Path:
    if w.policy is not None:
        return w.policy
    return untrained_policy(ctx, demo) if w.untrained else demo / "policy"


def untrained_policy(ctx: BenchContext, demo: Path) -> Path:
    """The demo's policy architecture and tokenizer, freshly initialised (seed 0), saved once per invocation."""
    path = ctx.workdir / "untrained-policy"
    if not (path / "config.json").is_file():
        from stream_rl.demo.model import build_policy
        from stream_rl.models.loading import load_tokenizer, save_model

        tokenizer = load_tokenizer(demo / "policy")
        save_model(build_policy(tokenizer, seed=0), tokenizer, path)
    return path


def deadline_s(w: Workload) -> float:
    return 180.0 + w.steps * ((4.0 if w.max_new_tokens <= 8 else 20.0) + 1.5 * w.reward_delay_s)


@dataclass
class Trace:
    """One run of one system: its step rows reduced to what is compared."""

    wall_s: float
    times: list[float]  # end of each optimizer step, seconds since the end of the first
    rewards: list[float]
    samples: list[int]
    stages: dict[str, float]  # per-step medians of the system's own stage timers
    reference: bool = False  # stream-rl's scorer computed reference-model log-probs (its resolved config says so)
    snapshots: dict[int, Path] = field(default_factory=dict)  # step -> the policy's weights after it (safetensors)

    def timings(self) -> dict[str, float]:
        span = self.times[-1]
        return {"span_s": span, "wall_s": self.wall_s, "samples_s": sum(self.samples[1:]) / span}

    def reward_ends(self) -> dict[str, float]:
        """Mean reward of the first and of the last 10 % of steps (:func:`reward_ends`)."""
        first, last = reward_ends(self.rewards)
        return {"reward_first": first, "reward_last": last}


def reward_ends(rewards: Sequence[float]) -> tuple[float, float]:
    """Mean reward of the first and of the last 10 % of steps (at least one step each)."""
    k = max(1, len(rewards) // 10)
    return statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])


def _run(cmd: list[str], env: Mapping[str, str], log: Path, timeout: float) -> float:
    """Run ``cmd`` from the repository root, output to ``log``; its wall seconds; raises with the log's tail.

    Past ``timeout`` the child gets SIGTERM (``stream-rl run`` then stops its roles), SIGKILL 60 s later."""
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=dr.ROOT, env=dict(env), stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}\n{log.read_text()[-LOG_TAIL:]}")
    return wall


def _env(threads: int | None) -> dict[str, str]:
    """This environment, offline; torch threads pinned to ``threads``, or left to each role (None: stream-rl's
    supervisor gives every role one thread unless ``OMP_NUM_THREADS`` is already set, so it is removed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def run_trl(ctx: BenchContext, demo: Path, w: Workload) -> Trace:
    out = ctx.workdir / f"trl-{w.name}-{uuid.uuid4().hex[:8]}.jsonl"
    cmd = [sys.executable, "-m", "bench.trl_worker", "--demo-dir", str(demo), "--out", str(out), "--steps",
           str(w.steps), "--max-new-tokens", str(w.max_new_tokens), "--threads", str(TRL_THREADS), "--seed",
           str(w.seed), "--policy-dir", str(policy_dir(ctx, demo, w)), "--reward-delay-s", str(w.reward_delay_s),
           "--reward", w.trl_reward]
    saved = out.with_suffix(".snapshots")
    if w.snapshot_every:
        cmd += ["--save-every", str(w.snapshot_every), "--save-dir", str(saved)]
    wall = _run(cmd, _env(TRL_THREADS), out.with_suffix(".log"), deadline_s(w))
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step" in r]
    _check_steps(len(steps), w, out.with_suffix(".log"))
    return Trace(wall, _since_first([r["t"] for r in steps]), [r["reward_mean"] for r in steps],
                 [int(r["samples"]) for r in steps], stage_medians(steps),
                 snapshots=snaps.snapshots(saved, w.steps, w.snapshot_every))


def stream_command(ctx: BenchContext, demo: Path, w: Workload, run: str, run_dir: Path) -> list[str]:
    """``stream-rl run`` on the demo config exactly as ``make run`` runs it (its own local broker with durable
    storage, started and stopped by the command, in a state directory of this run; the demo's checkpoints and
    placement), a fresh run, without the demo's held-out evaluator (TRL runs none); the step budget and response
    length of ``w`` (and its policy when it is not the demo's)."""
    sets = {"broker.state_dir": run_dir / "broker", "topics.run": run, "run_dir": run_dir, "run.demo_dir": demo,
            "trainer.max_steps": w.steps, "producer.max_new_tokens": w.max_new_tokens,
            "run.max_wall_s": deadline_s(w), "eval": "null"}  # TRL evaluates nothing: neither does this run
    if w.untrained or w.policy is not None:
        policy = policy_dir(ctx, demo, w)
        sets.update({"producer.model_dir": policy, "trainer.model_dir": policy})
    if w.reward_delay_s:
        sets["scorer.reward_fn"] = DELAYED_REWARD
    if w.seed:
        sets.update({"producer.seed": w.seed, "trainer.seed": w.seed})
    sets.update(dict(w.stream_sets))
    cmd = [sys.executable, "-m", "stream_rl.cli.main", "run", "-c", str(dr.DEMO_TOML)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def run_stream(ctx: BenchContext, demo: Path, w: Workload) -> Trace:
    run = f"bench-trl-{w.name}-{uuid.uuid4().hex[:8]}"
    run_dir = ctx.workdir / run
    log = ctx.workdir / f"{run}.log"
    env = {**_env(None), DELAY_ENV: str(w.reward_delay_s)}  # read by the scorer's reward (bench.delayed_reward)
    with snaps.keeping(run_dir / "weights", run_dir / "snapshots", w.steps, w.snapshot_every) as kept:
        wall = _run(stream_command(ctx, demo, w, run, run_dir), env, log, deadline_s(w) + 120)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    _check_steps(len(rows), w, log, run_dir)
    stages = stream_stages(rows)
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    return Trace(wall, _since_first([r["time"] for r in rows]), [r["reward/mean"] for r in rows],
                 [int(r["batch/sequences"]) for r in rows], stages,
                 reference=resolved["scorer"].get("reference_model_dir") is not None,
                 snapshots=snaps.snapshots(kept, w.steps, w.snapshot_every))


STREAM_STAGES = {  # stage -> the trainer row's key (per step), from the telemetry the roles already export
    "generate_s": "time/generate_s_mean",  # the producer's generation of one batch (its own timer)
    "update_s": "time/update_s", "proximal_s": "time/proximal_s", "train_s": "time/train_s",
    "broadcast_s": "time/broadcast_s", "checkpoint_s": "time/checkpoint_s", "wait_s": "time/wait_s",
    "rollout_age_s": "time/rollout_age_s_mean",  # generation's end to the step that trains it
    "step_s": "time/step_s"}  # step_s: the trainer's work on a step (train, judge, broadcast, metrics), not its wait


def stream_stages(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per-step medians of stream-rl's own timers (:data:`STREAM_STAGES`); ``score_s``: the scorer's seconds for
    one step's rollouts (its per-rollout share times the rollouts of the step); ``interval_s``: between step ends."""
    out = {name: statistics.median(float(r.get(key, 0.0)) for r in rows) for name, key in STREAM_STAGES.items()}
    out["score_s"] = statistics.median(float(r.get("time/score_s_mean", 0.0)) * float(r["batch/sequences"])
                                       for r in rows)
    ends = [float(r["time"]) for r in rows]
    out["interval_s"] = statistics.median(b - a for a, b in zip(ends, ends[1:])) if len(ends) > 1 else 0.0
    return out


def _check_steps(done: int, w: Workload, log: Path, run_dir: Path | None = None) -> None:
    if done != w.steps:
        tails = dr.log_tails(run_dir) if run_dir is not None else ""
        raise RuntimeError(f"{log.name}: {done} of {w.steps} steps\n{log.read_text()[-LOG_TAIL:]}\n{tails}")


def _since_first(times: Sequence[float]) -> list[float]:
    return [float(t) - float(times[0]) for t in times]


def require_trl(benchmark: str) -> None:
    """RuntimeError naming ``benchmark`` (e.g. ``"9 (trl)"``) and the install command when TRL is missing."""
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"benchmark {benchmark} needs TRL: pip install -e '.[trl]' ({exc})") from exc


def run(ctx: BenchContext) -> dict[str, Any]:
    require_trl("9 (trl)")
    demo = dr.demo_dir(ctx)
    loads = workloads(ctx)
    samples: dict[str, list[float]] = {}
    rewards: dict[str, list[float]] = {}
    stages: dict[str, list[float]] = {}
    curves: dict[str, dict[str, list[dict[str, list[float]]]]] = {w.name: {s: [] for s in SYSTEMS} for w in loads}
    reference = False
    for w, system, trace in traces(ctx, demo, loads):
        prefix = f"{w.name}.{system}"
        collect(samples, prefix, trace.timings())
        collect(samples if not w.untrained else rewards, prefix, trace.reward_ends())
        collect(stages, prefix, trace.stages)
        curves[w.name][system].append({"t": trace.times, "reward": trace.rewards})
        reference = reference or trace.reference
    params = _params(ctx, loads, stages)
    params["rewards"] = {name: float(statistics.median(v)) for name, v in rewards.items()}
    params["stream_reference_logprobs"] = reference
    result = {"figures": _figures(samples, loads), "samples": samples, "curves": curves,
              "notes": _notes(loads), "params": params}
    if ctx.mode == "full":
        plot(result, PLOT)
        result["params"]["plot"] = str(PLOT.relative_to(dr.ROOT))
    return result


def traces(ctx: BenchContext, demo: Path, loads: Sequence[Workload]) -> Iterator[tuple[Workload, str, Trace]]:
    """Every run of the benchmark, in order: per round (``ctx.rounds``; TRL first in odd rounds, stream-rl first in
    even ones), per workload, one run of each system; each logged when done."""
    runners = {"trl": run_trl, "stream": run_stream}
    for round_no in range(ctx.rounds):
        order = SYSTEMS if round_no % 2 == 0 else SYSTEMS[::-1]
        for w in loads:
            for system in order:
                trace = runners[system](ctx, demo, w)
                ctx.log(f"  round {round_no + 1}/{ctx.rounds}: {w.name} {system} done "
                        f"({trace.times[-1]:.1f} s first to last step)")
                yield w, system, trace


def collect(into: dict[str, list[float]], prefix: str, values: Mapping[str, float]) -> None:
    """Append each of ``values`` to ``into["<prefix>.<name>"]`` (one sample per round)."""
    for name, value in values.items():
        into.setdefault(f"{prefix}.{name}", []).append(float(value))


def _figures(samples: Mapping[str, list[float]], loads: Sequence[Workload]) -> dict[str, float]:
    figures = {name: float(statistics.median(values)) for name, values in samples.items()}
    for w in loads:
        for what in ("span", "wall"):
            figures[f"{w.name}.{what}_ratio"] = figures[f"{w.name}.stream.{what}_s"] / figures[f"{w.name}.trl.{what}_s"]
        figures[f"{w.name}.samples_s_ratio"] = (figures[f"{w.name}.stream.samples_s"]
                                                / figures[f"{w.name}.trl.samples_s"])
    return figures


def _params(ctx: BenchContext, loads: Sequence[Workload], stages: Mapping[str, list[float]]) -> dict[str, Any]:
    import importlib.metadata as md

    from bench.trl_worker import MATCHED, UNMATCHED

    return {"workloads": [{"name": w.name, "max_new_tokens": w.max_new_tokens, "steps": w.steps,
                           "untrained": w.untrained} for w in loads],
            "rounds": ctx.rounds, "trl_threads": TRL_THREADS, "cores": dr.usable_cores(),
            "trl_version": md.version("trl"), "trl_settings": {**MATCHED, **UNMATCHED},
            "stages": {name: float(statistics.median(v)) for name, v in stages.items()},
            "order": "TRL first in odd rounds, stream-rl first in even rounds"}


def _notes(loads: Sequence[Workload]) -> list[str]:
    return [f"Workload {w.name}: {w.what}, {w.steps} optimizer steps of 256 rollouts (32 prompts x 8)."
            for w in loads] + [
        "Span: end of the first optimizer step to the end of the last (each system's own step rows); whole "
        "command: process start to exit (stream-rl's includes starting and stopping its own durable local "
        "broker, as `make run` does). Ratios are stream-rl / TRL.",
        "Stage times are per-step medians of each system's own timers: TRL's profiling timers and `step_time`; "
        "stream-rl's trainer rows (`time/*`, the producer's `generate_s` and the scorer's share carried on the "
        "rollouts)."]
