"""The scorer's pure step: rollouts in, scored rollouts (or rejections with a reason) out. No Kafka here.

Consumes: a batch of :class:`~schemas.Rollout` and a :class:`Scoring` (reward function or reward routes, reward
model, reference model, weights; built once per process by :func:`load_scoring`).
Produces: one item per rollout, in input order: a validated :class:`~schemas.ScoredRollout`, or a
:class:`Rejected` ``(rollout, reason, error_type)`` that the loop sends to the dead-letter topic.

Stages (each batched over the rollouts still alive; a rejected rollout skips the later, costlier stages)::

    rule-based reward fn or routed rewards (per rollout)  ->  reward model (batched)  ->  reference log-probs
    (batched)  ->  assemble

Combination rule (the only one, see :mod:`consumers.scorer.config`)::

    reward            = reward_fn_weight * r_fn + reward_model_weight * r_rm
    reward_components = {"reward_fn": reward_fn_weight * r_fn, "reward_model": reward_model_weight * r_rm}
    token_rewards     = reward_fn_weight * fn_token_rewards (or r_fn on the last token)
                        + reward_model_weight * r_rm on the last token       (only with token_level_rewards)

With routed rewards (``scoring.router``, :mod:`stream_rl.rewards.routing`) the rule-based part is the route's
``sum_i w_i * r_i`` with one component per function (named by its ``fn``) in place of ``reward_fn``; a rollout
whose metadata value has no route and no default is rejected with the reason naming the key and value
(``error_type`` ``UnroutedError``).

Reward calls (``scoring.services``, :mod:`consumers.scorer.services`): the rule-based rewards, the reward server
(``reward_server`` component) and the LLM judge (``judge`` component) run side by side with a deadline, bounded
concurrency and bounded retries; a call that times out or fails for good rejects the rollout with the reason
(``error_type`` ``Timeout`` or the exception's type) unless ``scorer.on_reward_error = "zero"``.

Guarantees: a rollout is rejected, never scored with a made-up value, when the reward function raises or returns a
non-finite/malformed value, a model cannot take its tokens, the reward model's score or a reference log-prob is
non-finite, or the assembled message fails schema validation. Errors that are not about one rollout (a model that
fails to run at all) propagate. ``timings`` carry each rollout's share of the batch's wall time per stage
(stage seconds / batch size, so sums over rollouts give the stage's total) and ``created_at``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from consumers.scorer.config import ScorerConfig
from stream_rl.rewards.contract import RewardFn
from schemas import ID_PATTERN, Rollout, SchemaError, ScoredRollout, validate
from consumers.scorer.services import RewardServices, build_services, service_rewards
from stream_rl.rewards.routing import RewardRouter, RoutedReward, resolve_fn

if TYPE_CHECKING:
    from consumers.scorer.reference import ReferenceLogprobs
    from consumers.scorer.reward_model import RewardModelScorer


class Rejected(NamedTuple):
    """A rollout that could not be scored and why; it goes to the dead-letter topic."""

    rollout: Rollout
    reason: str
    error_type: str


@dataclass(frozen=True)
class Scoring:
    """Everything the step needs, loaded once per process."""

    scorer_id: str
    reward_fn: RewardFn | None = None
    reward_fn_weight: float = 1.0
    reward_model: RewardModelScorer | None = None
    reward_model_weight: float = 1.0
    reference: ReferenceLogprobs | None = None
    token_level_rewards: bool = False
    router: RewardRouter | None = None
    services: RewardServices | None = None
    """The reward calls (consumers.scorer.services); None: built here from reward_fn / router, default policy."""

    def __post_init__(self) -> None:
        if self.services is None and (self.reward_fn is not None or self.router is not None):
            object.__setattr__(self, "services", build_services(None, reward_fn=self.reward_fn, router=self.router,
                                                                reward_fn_weight=self.reward_fn_weight))
        if self.services is None and self.reward_model is None:
            raise ValueError("Scoring needs a reward function, reward routes, a reward service and/or a reward "
                             "model")
        if self.reward_fn is not None and self.router is not None:
            raise ValueError("Scoring takes a reward function or reward routes, not both")
        if not ID_PATTERN.match(self.scorer_id):
            raise ValueError(f"scorer_id {self.scorer_id!r} does not match {ID_PATTERN.pattern}")
        for name in ("reward_fn_weight", "reward_model_weight"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")


def load_scoring(cfg: ScorerConfig, scorer_id: str) -> Scoring:
    """Import the reward function and load the models named by ``cfg`` (strict key checks, frozen) on
    ``cfg.device`` (``auto`` resolved here) in ``cfg.dtype``."""
    reward_model = reference = None
    if cfg.reward_model_dir is not None or cfg.reference_model_dir is not None:
        from stream_rl.models import resolve_device

        device = resolve_device(cfg.device, "scorer.device")  # before any weights are read
    if cfg.reward_model_dir is not None:
        from consumers.scorer.reward_model import RewardModelScorer

        reward_model = RewardModelScorer.from_dir(
            cfg.reward_model_dir, input_mode=cfg.reward_model_input, dtype=cfg.dtype, batch_size=cfg.batch_size,
            device=device)
    if cfg.reference_model_dir is not None:
        from consumers.scorer.reference import ReferenceLogprobs

        reference = ReferenceLogprobs.from_dir(cfg.reference_model_dir, dtype=cfg.dtype, batch_size=cfg.batch_size,
                                               device=device)
    reward_fn = resolve_fn(cfg.reward_fn) if cfg.reward_fn else None  # a short name or module:function
    router = RewardRouter.load(cfg.rewards.to_routes()) if cfg.rewards is not None else None
    preflight_rewards([reward_fn, *(router.fns.values() if router is not None else ())])
    if cfg.reward_isolation == "process":
        reward_fn, router = isolate_rewards(cfg, reward_fn, router)
    return Scoring(
        scorer_id=scorer_id, reward_fn=reward_fn, reward_fn_weight=cfg.reward_fn_weight, reward_model=reward_model,
        reward_model_weight=cfg.reward_model_weight, reference=reference,
        token_level_rewards=cfg.token_level_rewards, router=router,
        services=build_services(cfg, reward_fn=reward_fn, router=router, reward_fn_weight=cfg.reward_fn_weight))


def preflight_rewards(fns: Sequence[RewardFn | None]) -> None:
    """Each reward function's own start-up check (its ``preflight`` attribute, e.g. ``code_tests``: can this host
    sandbox programs?), once per function; its error propagates: the role refuses to start."""
    seen: set[int] = set()
    for fn in fns:
        check = getattr(fn, "preflight", None)
        if callable(check) and id(check) not in seen:
            seen.add(id(check))
            check()


def isolate_rewards(cfg: ScorerConfig, reward_fn: RewardFn | None,
                    router: RewardRouter | None) -> tuple[RewardFn | None, RewardRouter | None]:
    """``scorer.reward_isolation = "process"``: the same functions, each run in its own worker processes
    (:mod:`stream_rl.rewards.isolated`), bounded by ``reward_timeout_s``, ``reward_concurrency`` workers each."""
    from stream_rl.rewards.isolated import IsolatedReward

    def isolated(reference: str) -> IsolatedReward:
        return IsolatedReward(reference, timeout_s=cfg.reward_timeout_s, workers=cfg.reward_concurrency)

    if reward_fn is not None:
        reward_fn = isolated(cfg.reward_fn)
    if router is not None:
        router = dataclasses.replace(router, fns={name: isolated(name) for name in router.fns})
    return reward_fn, router


def score_rollouts(rollouts: Sequence[Rollout], scoring: Scoring, *,
                   clock: Callable[[], float] = time.perf_counter,
                   on_wait: Callable[[], None] | None = None) -> list[ScoredRollout | Rejected]:
    """Score ``rollouts``; one ScoredRollout or Rejected per input, in input order (``on_wait``: called about
    once a second while reward calls are in flight)."""
    rejected: dict[int, Rejected] = {}
    stage_s: dict[str, float] = {}

    def timed(name: str, stage: Callable[..., dict[int, Any]]) -> dict[int, Any]:
        start = clock()
        result = stage(rollouts, scoring, rejected)
        stage_s[name] = clock() - start
        return result

    def rule_stage(rollouts_, scoring_, rejected_) -> dict[int, RoutedReward]:
        rewards, failures = service_rewards(rollouts_, scoring_.services, rejected_, on_wait)
        rejected_.update({i: Rejected(rollouts_[i], reason, kind) for i, (reason, kind) in failures.items()})
        return rewards

    rule = timed("reward_fn_s", rule_stage) if scoring.services is not None else {}
    model = timed("reward_model_s", _model_rewards) if scoring.reward_model is not None else {}
    ref = timed("ref_logprobs_s", _reference_logprobs) if scoring.reference is not None else {}
    share = {name: seconds / max(len(rollouts), 1) for name, seconds in stage_s.items()}
    share["score_s"] = sum(share.values())
    out: list[ScoredRollout | Rejected] = []
    for i, rollout in enumerate(rollouts):
        if i in rejected:
            out.append(rejected[i])
            continue
        try:
            out.append(validate(_assemble(rollout, scoring, rule.get(i), model.get(i), ref.get(i), share)))
        except SchemaError as exc:
            out.append(Rejected(rollout, f"scored rollout is invalid: {exc}", "SchemaError"))
    return out


def _model_rewards(rollouts: Sequence[Rollout], scoring: Scoring,
                   rejected: dict[int, Rejected]) -> dict[int, float]:
    live, sequences = [], []
    for i, r in enumerate(rollouts):
        if i in rejected:
            continue
        try:
            sequences.append(scoring.reward_model.token_ids(r))
            live.append(i)
        except ValueError as exc:
            rejected[i] = Rejected(r, f"reward model cannot score this rollout: {exc}", "ValueError")
    scores = scoring.reward_model.scores(sequences) if sequences else []
    out = {}
    for i, score in zip(live, scores, strict=True):
        if math.isfinite(score):
            out[i] = score
        else:
            rejected[i] = Rejected(rollouts[i], f"reward model returned a non-finite score {score}", "NonFinite")
    return out


def _reference_logprobs(rollouts: Sequence[Rollout], scoring: Scoring,
                        rejected: dict[int, Rejected]) -> dict[int, np.ndarray]:
    live = []
    for i, r in enumerate(rollouts):
        if i in rejected:
            continue
        try:
            scoring.reference.check(r)
            live.append(i)
        except ValueError as exc:
            rejected[i] = Rejected(r, f"reference model cannot score this rollout: {exc}", "ValueError")
    values = scoring.reference.logprobs([rollouts[i] for i in live]) if live else []
    out = {}
    for i, logp in zip(live, values, strict=True):
        if np.isfinite(logp).all():
            out[i] = logp
        else:
            bad = np.flatnonzero(~np.isfinite(logp))[:5].tolist()
            rejected[i] = Rejected(rollouts[i], f"reference log-probabilities are non-finite at response "
                                                f"positions {bad}", "NonFinite")
    return out


def _assemble(rollout: Rollout, scoring: Scoring, rule: RoutedReward | None, model: float | None,
              ref: np.ndarray | None, share: dict[str, float]) -> ScoredRollout:
    components: dict[str, float] = {}
    if rule is not None:
        components.update(rule.components)  # already weighted
    if model is not None:
        components["reward_model"] = scoring.reward_model_weight * model
    token_rewards = None
    if scoring.token_level_rewards:
        dense = np.zeros(rollout.response_length, dtype=np.float64)  # [R]
        if rule is not None:
            if rule.token_rewards is not None:
                dense += rule.token_rewards.astype(np.float64)  # already weighted
            else:
                dense[-1] += rule.reward
        if model is not None:
            dense[-1] += components["reward_model"]
        token_rewards = dense.astype(np.float32)
    return ScoredRollout(rollout=rollout, reward=float(sum(components.values())), reward_components=components,
                         token_rewards=token_rewards, ref_logprobs=ref, scorer_id=scoring.scorer_id,
                         timings={**share, "created_at": time.time()})


def batch_metrics(outputs: Sequence[ScoredRollout | Rejected]) -> dict[str, float]:
    """Namespaced metrics of one scored batch (logged once per batch by the loop)."""
    scored = [o for o in outputs if isinstance(o, ScoredRollout)]
    rewards = np.array([o.reward for o in scored], dtype=np.float64)
    metrics = {"scorer/rollouts": float(len(outputs)), "scorer/scored": float(len(scored)),
               "scorer/rejected": float(len(outputs) - len(scored))}
    if scored:
        metrics["scorer/reward_mean"] = float(rewards.mean())
        metrics["scorer/reward_std"] = float(rewards.std())
        metrics["scorer/score_s"] = float(sum(o.timings.get("score_s", 0.0) for o in scored))
    return metrics
