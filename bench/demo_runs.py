"""Shared plumbing of the benchmarks that run the built-in demo: the demo build, the stages alone in this process,
and whole pipelines as real role processes, each pinned to a core.

Consumes: a :class:`~bench.common.BenchContext` (broker, size mode, scratch directory) and ``configs/demo.toml``.
Produces:
- :func:`demo_dir`: the demo (``stream_rl.demo.init_demo``, seed 0) built once into ``ctx.workdir/demo`` and
  reused by every benchmark of the invocation (or the directory named by ``$BENCH_DEMO_DIR``, which the test
  suite points at its session build);
- :func:`demo_config`: the demo config on the bench broker with a fresh run (topics) and run directory, its
  model/reward/prompt settings pointed at the demo, the reward model scored at weight 0 (its cost is paid, the
  reward stays the verifier's) and overrides applied;
- :class:`Stages`: generate (HF engine), score (reward function + reward model + reference log-probs) and train
  (``build_batch`` + ``rollout_metrics`` + ``train_step``) timed alone, one after the other in this process on one
  thread, in response tokens per second;
- :func:`run_pipeline`: producer, scorer and trainer started by :class:`stream_rl.launch.orchestrator.Supervisor` as
  ``stream-rl run`` starts them, pinned to cores once training has started, run to ``trainer.max_steps``; returns
  the trainer's ``metrics.jsonl`` rows and the batcher's drop counters;
- :func:`stage_samples`: benchmark 2's stage samples when it ran earlier in the same invocation, else new ones.
Guarantees: every process started here is stopped (SIGTERM, then SIGKILL) by the Supervisor before the function
returns, also on errors; a run that does not finish in its deadline raises with the tail of every role's log.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import BenchContext

ROOT = Path(__file__).resolve().parent.parent
DEMO_TOML = ROOT / "configs" / "demo.toml"
DEMO_DIR_ENV = "BENCH_DEMO_DIR"
"""A demo directory to use instead of building one (the test suite's session build)."""
LOG_TAIL_CHARS = 1500


def demo_dir(ctx: BenchContext) -> Path:
    """The demo of this invocation: ``$BENCH_DEMO_DIR``, else built once (about 60-100 s) in ``ctx.workdir``."""
    given = os.environ.get(DEMO_DIR_ENV)
    if given:
        path = Path(given)
        if not (path / "policy").is_dir():
            raise FileNotFoundError(f"${DEMO_DIR_ENV}={given} holds no built demo (no policy/ directory)")
        return path
    path = ctx.workdir / "demo"
    if not (path / "demo.json").is_file():
        import torch

        from stream_rl.demo.init import init_demo
        from stream_rl.demo.sft import SFTConfig

        # quick and tiny runs stop the warm-start at a lower sampled accuracy: a shorter build, same code path
        sft = ctx.pick(full=None, quick=SFTConfig(target_accuracy=0.1), tiny=SFTConfig(target_accuracy=0.1))
        ctx.log(f"building the demo in {path} (supervised warm-start, about a minute)")
        threads = torch.get_num_threads()
        try:
            init_demo(path, seed=0, sft=sft)
        finally:
            torch.set_num_threads(threads)
    return path


def demo_config(ctx: BenchContext, demo: Path, prefix: str, **overrides: Any):
    """The demo's config on this broker: fresh topics and run directory, demo models, reward model at weight 0."""
    import uuid

    from stream_rl.cli.config import load_config

    run = f"{prefix}-{uuid.uuid4().hex[:8]}"
    base = {
        "kafka.bootstrap_servers": ctx.bootstrap, "topics.run": run, "run_dir": str(ctx.workdir / run),
        "run.demo_dir": str(demo), "producer.model_dir": str(demo / "policy"),
        "trainer.model_dir": str(demo / "policy"), "scorer.reference_model_dir": str(demo / "reference"),
        "scorer.reward_model_dir": str(demo / "reward_model"), "scorer.reward_model_weight": 0.0,
        "scorer.reward_fn": "stream_rl.demo.task:addition_reward", "run.prompts_file": str(demo / "prompts.jsonl"),
        "producer.poll_timeout_s": 0.2, "scorer.poll_timeout_s": 0.2, "trainer.poll_timeout_s": 0.2,
        "producer.weights_startup_wait_s": 1.0, "trainer.checkpoint_every": 100_000,
    }
    return load_config(DEMO_TOML, env={}, overrides={**base, **overrides})


def demo_prompts(demo: Path, count: int, group_size: int, epochs: int = 1) -> list:
    """The first ``count`` demo training prompts (already shuffled by the build's seed) as Prompt records."""
    from stream_rl.prompts import prompt_messages, read_prompt_file

    rows = read_prompt_file(demo / "prompts.jsonl")
    if count > len(rows):
        raise ValueError(f"asked for {count} demo prompts, the demo has {len(rows)}")
    return prompt_messages(rows[:count], epochs, group_size)


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pin(pid: int, core: int) -> None:
    """Pin every thread of process ``pid`` (threads started later inherit it from the main thread)."""
    tasks = Path(f"/proc/{pid}/task")
    for tid in ([int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [pid]):
        try:
            os.sched_setaffinity(tid, {core})
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended


# ---------------------------------------------------------------- the stages alone


@dataclass
class Stages:
    """Generate, score and train on the demo, one stage at a time, in this process (one torch thread)."""

    cfg: Any
    demo: Path
    steps: int
    prompts: list = field(default_factory=list)
    _rollouts: list = field(default_factory=list)
    _scored: list = field(default_factory=list)

    def __post_init__(self) -> None:
        from consumers.scorer.scoring import load_scoring
        from consumers.trainer.engines import TrainModule, build_engine
        from consumers.trainer.train_step import TrainState
        from producers.engines import build_engine as build_generator
        from stream_rl.models import load_policy

        self.generator = build_generator(self.cfg.producer)
        self.scoring = load_scoring(self.cfg.scorer, "bench-scorer")
        policy, tokenizer = load_policy(self.cfg.trainer.model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.trainer = build_engine(TrainModule(policy), self.cfg.trainer)
        self.state = TrainState()
        self.per_step = self.cfg.trainer.groups_per_step
        self.prompts = demo_prompts(self.demo, self.per_step * self.steps * 2, self.cfg.run.group_size)
        self._next = 0

    def generate(self) -> dict[str, float]:
        from producers.step import produce_rollouts

        pcfg, rollouts, seconds = self.cfg.producer, [], 0.0
        for _ in range(self.steps):
            batch = self.prompts[self._next:self._next + self.per_step]
            self._next = (self._next + self.per_step) % (len(self.prompts) - self.per_step)
            t0 = time.perf_counter()
            result = produce_rollouts(batch, self.generator, producer_id="bench-producer",
                                      sampling=pcfg.sampling(), max_new_tokens=pcfg.max_new_tokens,
                                      seed=pcfg.seed, group_size=pcfg.group_size)
            seconds += time.perf_counter() - t0
            rollouts.append(result.rollouts)
        self._rollouts = rollouts
        return {"generate_tokens_s": _tokens(rollouts) / seconds, "generate_step_s": seconds / self.steps}

    def score(self) -> dict[str, float]:
        from consumers.scorer.scoring import score_rollouts

        size, scored, seconds = self.cfg.scorer.batch_size, [], 0.0
        for rollouts in self._rollouts:
            t0 = time.perf_counter()
            step = [o for i in range(0, len(rollouts), size) for o in score_rollouts(rollouts[i:i + size],
                                                                                   self.scoring)]
            seconds += time.perf_counter() - t0
            if any(not hasattr(o, "reward") for o in step):
                raise RuntimeError(f"the scorer rejected rollouts: {[o.reason for o in step if hasattr(o, 'reason')]}")
            scored.append(step)
        self._scored = scored
        return {"score_tokens_s": _tokens([[s.rollout for s in step] for step in scored]) / seconds,
                "score_step_s": seconds / len(scored)}

    def train(self) -> dict[str, float]:
        """The trainer's step as configured (the demo: one update per batch, so no separate proximal pass)."""
        return self._train(self.cfg.trainer, "train")

    def train_always(self) -> dict[str, float]:
        """The same steps with ``recompute_proximal = "always"``: the old path, a no-grad pass before the update."""
        return self._train(self.cfg.trainer.model_copy(update={"recompute_proximal": "always"}), "train_always")

    def _train(self, tcfg, prefix: str) -> dict[str, float]:
        from consumers.trainer.rollout_metrics import rollout_metrics
        from consumers.trainer.tensors import build_batch
        from consumers.trainer.train_step import train_step

        seconds, tokens = 0.0, 0
        for scored in self._scored:  # what the trainer does per step, less Kafka, spans and the broadcast
            t0 = time.perf_counter()
            batch = build_batch(scored, self.pad_id)
            rollout_metrics(scored, self.state.version, tcfg.success_threshold)
            train_step(self.trainer, batch, tcfg, self.state)
            seconds += time.perf_counter() - t0
            tokens += batch.n_tokens
        return {f"{prefix}_tokens_s": tokens / seconds, f"{prefix}_step_s": seconds / len(self._scored)}

    def close(self) -> None:
        self.generator.close()


def _tokens(batches: Sequence[Sequence[Any]]) -> int:
    return sum(r.response_length for batch in batches for r in batch)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside the block (each role process runs with ``OMP_NUM_THREADS=1``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_STAGE_SAMPLES: dict[Path, dict[str, list[float]]] = {}
"""Stage samples measured by benchmark 2 in this invocation, by workdir, for benchmark 3 to reuse."""


def remember_stages(ctx: BenchContext, samples: Mapping[str, list[float]]) -> None:
    _STAGE_SAMPLES[ctx.workdir] = {k: list(v) for k, v in samples.items()}


def stage_samples(ctx: BenchContext, cfg, demo: Path, steps: int) -> tuple[dict[str, list[float]], bool]:
    """The stages' samples: benchmark 2's from this invocation (True), else measured now (False)."""
    if ctx.workdir in _STAGE_SAMPLES:
        return _STAGE_SAMPLES[ctx.workdir], True
    from bench.common import interleave

    stages = Stages(cfg, demo, steps)
    try:
        with one_thread():
            samples = interleave([(name, getattr(stages, name)) for name in ("generate", "score", "train")],
                                 ctx.rounds, ctx.log, ctx.min_rounds)
    finally:
        stages.close()
    remember_stages(ctx, samples)
    return samples, False


# ---------------------------------------------------------------- whole pipelines


@dataclass
class PipelineRun:
    """What one pipeline run left: the trainer's metric rows, its stale drops, where each role ran."""

    rows: list[dict]
    stale: int
    requeued: int
    placement: dict[str, int]
    run_dir: Path


def placement(cores: Sequence[int], alone: str) -> dict[str, int]:
    """Which core each role gets: ``alone`` has a core to itself when there are two, the other roles share one;
    with three or more cores every role has its own; with one, all share it."""
    roles = ["train", "score", "produce"]
    if len(cores) >= 3:
        return dict(zip(roles, cores[:3]))
    if len(cores) == 2:
        return {role: cores[0] if role == alone else cores[1] for role in roles}
    return {role: cores[0] for role in roles}


def run_pipeline(ctx: BenchContext, cfg, prompts: list, alone: str, deadline_s: float,
                 extra: Sequence[str] = ()) -> PipelineRun:
    """Load ``prompts``, start trainer, scorer and producer as processes, wait for the trainer's step budget.
    ``extra``: more roles to start (``"evaluate"``: the evaluator, pinned with the producer, as ``run`` does).

    The roles start unpinned (three processes importing torch on two cores load fastest where the kernel puts
    them) and are pinned to their cores (:func:`placement`) when the trainer's first metrics row appears, so
    every step after the first runs pinned."""
    from stream_rl.launch.orchestrator import Supervisor, read_new_metrics, write_run_config
    from stream_rl.prompts import publish_prompts
    from stream_rl.transport.client import Transport

    transport = Transport(cfg, "bench")
    transport.ensure_topics()
    publish_prompts(transport, prompts)
    transport.tracing.shutdown()
    run_dir, metrics = Path(cfg.run_dir), Path(cfg.run_dir) / "metrics.jsonl"
    sup = Supervisor(run_dir, write_run_config(cfg, run_dir))
    where = placement(usable_cores(), alone)
    pids = {role: sup.start(role, 0).proc.pid for role in ("train", "score", "produce", *extra)}
    rows: list[dict] = []
    offset, pinned, started = 0, False, time.monotonic()
    try:
        while len(rows) < cfg.trainer.max_steps:
            new, offset = read_new_metrics(metrics, offset)
            rows += new
            if rows and not pinned:
                for role, pid in pids.items():
                    pin(pid, where.get(role, where["produce"]))
                pinned = True
            if sup.check(expected_done={"train-0"}) is not None:
                rows += read_new_metrics(metrics, offset)[0]
                break
            if time.monotonic() - started > deadline_s:
                break
            time.sleep(0.2)
    finally:
        sup.stop_all()
    if len(rows) < cfg.trainer.max_steps:
        raise RuntimeError(f"pipeline {cfg.topics.run} trained {len(rows)} of {cfg.trainer.max_steps} steps in "
                           f"{deadline_s:.0f} s\n{log_tails(run_dir)}")
    last = rows[-1]
    return PipelineRun(rows, int(last.get("batcher/stale_total", 0) or 0),
                       int(last.get("batcher/requeued_total", 0) or 0), where, run_dir)


def log_tails(run_dir: Path) -> str:
    parts = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-LOG_TAIL_CHARS:]}")
    return "\n".join(parts)


def window(rows: Sequence[Mapping[str, Any]], skip: int, steps: int) -> tuple[float, int, int]:
    """Wall seconds, response tokens and samples from the end of step ``skip`` to the end of ``skip + steps``.

    Rows are the trainer's metrics.jsonl lines (``step`` counts from 0, ``time`` is written after the step)."""
    if len(rows) < skip + steps or skip < 1:
        raise ValueError(f"need at least {skip + steps} steps and skip >= 1, got {len(rows)} and {skip}")
    span = rows[skip:skip + steps]
    seconds = float(span[-1]["time"]) - float(rows[skip - 1]["time"])
    return seconds, int(sum(r["batch/tokens"] for r in span)), int(sum(r["batch/sequences"] for r in span))


def mean_of(rows: Sequence[Mapping[str, Any]], key: str, last: int) -> float:
    values = [float(r[key]) for r in rows[-last:] if isinstance(r.get(key), (int, float))]
    if not values:
        raise ValueError(f"no {key} in the last {last} metric rows")
    return sum(values) / len(values)


def dump_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
