"""An in-process RL loop on the built-in demo with a fixed staleness: the pipeline's pure steps, no Kafka.

Consumes: a built demo directory (``stream_rl.demo.init_demo``), the trainer config (the demo's, with its loss
settings), and a :class:`LoopSpec` (steps, batch, staleness ``lag``, the loss variant, seed).
Produces: a :class:`LoopResult`: the reward of every trained batch, the final policy's reward on held-out prompts,
and the mean of a few loss diagnostics (clip fraction, importance weights).
Guarantees:
- Each step's rollouts come from :func:`producers.step.produce_rollouts` with the HF engine holding the policy of
  exactly ``lag`` versions before the trainer's current one (version 0 while fewer than ``lag`` updates exist), are
  scored by :func:`consumers.scorer.scoring.score_rollouts` with the demo's verifier, padded by
  :func:`consumers.trainer.tensors.build_batch` and trained on once; so the staleness of every token is exactly
  ``min(lag, step)`` versions, the maximum the pipeline's ``max_lag`` allows.
- Loss variants: ``decoupled`` and ``uncorrected`` are :func:`consumers.trainer.train_step.train_step` with
  ``loss.off_policy_correction`` true / false (ratio against the trainer's proximal recomputation, times the
  truncated importance weight pi_prox / mu or not); ``ppo_mu`` is plain PPO whose ratio is taken against the
  behaviour logprobs mu (AReaL's baseline; not a trainer option): the trainer's own :func:`update` with mu as the
  old logprobs and no weight.
- Deterministic for a seed: prompts (order by seed), sampling seeds and minibatch order depend only on the seed
  and the step, so the variants of one seed see the same prompts (paired comparison).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from producers.engines.base import Sampling

VARIANTS = ("decoupled", "uncorrected", "ppo_mu")
REWARD_FUNCTION = "stream_rl.demo.task:addition_reward"


@dataclass(frozen=True)
class LoopSpec:
    steps: int
    prompts_per_step: int
    group_size: int
    lag: int
    variant: str
    seed: int
    eval_prompts: int
    max_new_tokens: int = 6
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.lag < 0 or self.steps < 1:
            raise ValueError(f"need lag >= 0 and steps >= 1, got lag={self.lag}, steps={self.steps}")


@dataclass
class LoopResult:
    train_rewards: list[float]
    eval_reward: float
    seconds: float
    start_eval_reward: float | None = None
    diagnostics: dict[str, float] = field(default_factory=dict)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_prompts(rows: list[dict], count: int, start: int, group_size: int) -> list:
    """``count`` prompts from ``rows`` cycling from index ``start`` (the epoch counts the cycles)."""
    from schemas import Prompt

    out = []
    for i in range(start, start + count):
        row = rows[i % len(rows)]
        out.append(Prompt(prompt_id=row["prompt_id"], epoch=i // len(rows), text=row["text"], answer=row["answer"],
                          group_size=group_size))
    return out


def variant_config(tcfg, variant: str):
    """The trainer config for ``variant``: the correction flag set, KL off (no reference in this loop)."""
    loss = tcfg.loss.model_copy(update={"off_policy_correction": variant == "decoupled"})
    kl = tcfg.kl.model_copy(update={"coef": 0.0})
    return tcfg.model_copy(update={"loss": loss, "kl": kl})


def ppo_behaviour_step(engine, batch, cfg, state) -> dict[str, float]:
    """Plain PPO against the behaviour logprobs: the trainer's :func:`update` with mu as the old logprobs."""
    from consumers.trainer.targets import ADVANTAGE_ESTIMATORS, BatchTargets, advantage_inputs
    from consumers.trainer.train_step import lr_at
    from consumers.trainer.update import update

    if cfg.loss.off_policy_correction or cfg.advantage == "gae":
        raise ValueError("ppo_mu needs loss.off_policy_correction = false and a sequence advantage estimator")
    kl_t = torch.zeros_like(batch.behavior_logp)
    advantages, _ = ADVANTAGE_ESTIMATORS[cfg.advantage](advantage_inputs(batch, kl_t, 0.0, cfg, None))
    targets = BatchTargets(batch.behavior_logp, advantages, None, None)
    lr = lr_at(state.step, cfg)
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + state.step)
    out: dict[str, float] = {}
    for _ in range(cfg.epochs):
        order = torch.randperm(batch.size, generator=generator)
        for rows in order.tensor_split(min(cfg.minibatches, batch.size)):
            applied, _, metrics = update(engine, batch, targets, rows, cfg, 0.0, lr)
            state.applied_updates += applied
            state.skipped_updates += not applied
            out.update(metrics)
    state.step += 1
    return out


class DemoLoop:
    """One run: a fresh trainer engine and HF engine from the demo policy, snapshots of the last ``lag`` versions."""

    def __init__(self, demo: Path, tcfg, spec: LoopSpec):
        from stream_rl.rewards.contract import load_reward_fn
        from consumers.scorer.scoring import Scoring
        from consumers.trainer.engines import TrainModule, build_engine
        from consumers.trainer.train_step import TrainState, train_step
        from producers.engines.hf import HFEngine
        from stream_rl.models import load_policy

        self.spec, self.cfg = spec, variant_config(tcfg, spec.variant)
        torch.manual_seed(spec.seed)
        policy, tokenizer = load_policy(demo / "policy")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.engine = build_engine(TrainModule(policy), self.cfg)
        self.producer = HFEngine.from_dir(demo / "policy")
        self.state = TrainState(kl_coef=0.0)
        self.snapshots = {0: self._snapshot()}
        self.scoring = Scoring(scorer_id="bench-offpolicy", reward_fn=load_reward_fn(REWARD_FUNCTION))
        self.rows = read_rows(demo / "prompts.jsonl")
        random.Random(spec.seed).shuffle(self.rows)
        self.eval_rows = read_rows(demo / "eval_prompts.jsonl")[: spec.eval_prompts]
        self.step_fn: Callable = ppo_behaviour_step if spec.variant == "ppo_mu" else train_step

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.engine.policy_state_dict().items()}

    def _use_version(self, version: int) -> None:
        if self.producer.version != version:
            self.producer.load_weights(self.snapshots[version], version)

    def _scored(self, prompts, seed: int) -> list:
        from consumers.scorer.scoring import Rejected, score_rollouts
        from producers.step import produce_rollouts

        rollouts = produce_rollouts(prompts, self.producer, producer_id="bench-offpolicy",
                                    sampling=Sampling(self.spec.temperature), max_new_tokens=self.spec.max_new_tokens,
                                    seed=seed).rollouts
        scored = score_rollouts(rollouts, self.scoring)
        bad = [s for s in scored if isinstance(s, Rejected)]
        if bad:
            raise RuntimeError(f"{len(bad)} rollouts could not be scored, e.g.: {bad[0].reason}")
        return scored

    def train_one(self) -> tuple[float, dict[str, float]]:
        """Generate with the stale policy, score, train once; returns the batch's mean reward and loss metrics."""
        from consumers.trainer.tensors import build_batch

        spec, step = self.spec, self.state.step
        self._use_version(max(0, self.state.version - spec.lag))
        prompts = make_prompts(self.rows, spec.prompts_per_step, step * spec.prompts_per_step, spec.group_size)
        scored = self._scored(prompts, seed=spec.seed * 1_000_003 + step)
        metrics = self.step_fn(self.engine, build_batch(scored, self.pad_id), self.cfg, self.state)
        self.state.version = self.state.step
        self.snapshots[self.state.version] = self._snapshot()
        self.snapshots.pop(self.state.version - spec.lag - 1, None)
        return sum(s.reward for s in scored) / len(scored), metrics

    def evaluate(self, version: int) -> float:
        """Mean verifier reward of one sample per held-out prompt under the policy of ``version``."""
        self._use_version(version)
        prompts = make_prompts(self.eval_rows, len(self.eval_rows), 0, 1)
        scored = self._scored(prompts, seed=10**9 + self.spec.seed)
        return sum(s.reward for s in scored) / len(scored)


DIAGNOSTICS = ("policy/clipfrac", "policy/is_weight_mean", "policy/is_clipped_frac", "policy/approx_kl")


def run_loop(demo: Path, tcfg, spec: LoopSpec, eval_start: bool = False) -> LoopResult:
    """Train ``spec.steps`` steps and evaluate the final policy (and the initial one with ``eval_start``)."""
    started = time.perf_counter()
    loop = DemoLoop(demo, tcfg, spec)
    start = loop.evaluate(0) if eval_start else None
    rewards: list[float] = []
    sums: dict[str, float] = {}
    for _ in range(spec.steps):
        reward, metrics = loop.train_one()
        rewards.append(reward)
        for key in DIAGNOSTICS:
            if key in metrics:
                sums[key] = sums.get(key, 0.0) + float(metrics[key])
    final = loop.evaluate(loop.state.version)
    diagnostics = {key.split("/", 1)[1]: value / spec.steps for key, value in sums.items()}
    return LoopResult(rewards, final, time.perf_counter() - started, start, diagnostics)
