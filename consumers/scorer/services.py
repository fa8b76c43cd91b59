"""The scorer's reward calls: every rule-based reward (``reward_fn`` or routed rewards), the HTTP reward server
(``reward_url``) and the LLM judge (``judge``) called through :class:`stream_rl.rewards.calls.RewardCaller`, with
the deadline, concurrency and retries of ``scorer.reward_*``, and their metrics.

Consumes: a batch of rollouts and :class:`RewardServices` (one caller per reward, built once per process).
Produces: per rollout either a :class:`~stream_rl.rewards.routing.RoutedReward` (the weighted sum, one component
per reward: ``reward_fn`` or the route's ``fn`` names, ``reward_server``, ``judge``) or a failure ``(reason,
error_type)``; and :class:`CallStats` for the metrics.

Guarantees:
- Every reward of a batch is submitted before any is awaited: the rewards run side by side, each with at most
  ``reward_concurrency`` calls in flight; while waiting, ``on_wait`` is called about once a second (the loop's
  heartbeat).
- A rollout whose reward call timed out or failed for good is a failure with the reason (``reward 'name': ...``
  for routed and service rewards), unless ``on_reward_error = "zero"``: then that reward counts 0 and the
  rollout's failure is counted under ``zeroed``. Never a silent 0. A rollout without a route fails with
  ``UnroutedError``.
- Combination (as :mod:`stream_rl.rewards.routing`)::

      reward = sum_k w_k * r_k;  components = {name_k: w_k * r_k};
      token_rewards = sum_k w_k * t_k  [R]  (t_k = r_k on the last token where reward k gave none;
                      None when no reward gave token rewards)
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas import Rollout
from stream_rl.rewards.calls import CallExecutor, CallOutcome, CallPolicy, RewardCaller, RewardRequest
from stream_rl.rewards.contract import RewardFnError, RewardOutput
from stream_rl.rewards.routing import RewardRouter, RoutedReward, UnroutedError, route

Term = tuple[str, float]  # (component name, weight)
log = logging.getLogger(__name__)


@dataclass
class CallStats:
    """Outcomes seen since the last :meth:`drain`, by (reward name, data source)."""

    seen: dict[tuple[str, str], list[CallOutcome]] = field(default_factory=lambda: defaultdict(list))
    zeroed: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def drain(self) -> dict[str, float]:
        """``rewards/{name}/{data_source}/{latency_p50_s, latency_p99_s, calls, timeouts, retries, errors,
        zeroed}``; resets the counts."""
        out: dict[str, float] = {}
        for (name, source), outcomes in self.seen.items():
            key = f"rewards/{name}/{source}"
            latency = np.array([o.latency_s for o in outcomes], dtype=np.float64)
            out[f"{key}/latency_p50_s"] = float(np.percentile(latency, 50))
            out[f"{key}/latency_p99_s"] = float(np.percentile(latency, 99))
            out[f"{key}/calls"] = float(len(outcomes))
            out[f"{key}/timeouts"] = float(sum(o.timed_out for o in outcomes))
            out[f"{key}/retries"] = float(sum(o.retries for o in outcomes))
            out[f"{key}/errors"] = float(sum(not o.ok for o in outcomes))
            out[f"{key}/zeroed"] = float(self.zeroed.get((name, source), 0))
        self.seen.clear()
        self.zeroed.clear()
        return out


@dataclass
class RewardServices:
    """One caller per reward; ``fixed``: terms every rollout gets; ``router``: routed terms (by metadata)."""

    callers: Mapping[str, RewardCaller]
    fixed: tuple[Term, ...] = ()
    router: RewardRouter | None = None
    on_error: str = "dead_letter"
    data_key: str = "data_source"
    stats: CallStats = field(default_factory=CallStats)
    executor: CallExecutor | None = None  # the one event loop and thread pool every caller runs on

    def terms_for(self, rollout: Rollout) -> tuple[Term, ...]:
        routed = () if self.router is None else tuple((t.fn, t.weight) for t in route(self.router.routes,
                                                                                        rollout.metadata))
        return routed + self.fixed

    def close(self) -> None:
        for caller in self.callers.values():
            caller.close()
        if self.executor is not None:
            self.executor.close()


def build_services(cfg: Any, *, reward_fn: Callable | None, router: RewardRouter | None,
                   reward_fn_weight: float = 1.0) -> RewardServices | None:
    """Callers for ``reward_fn`` or the router's functions, ``cfg.reward_url`` and ``cfg.judge`` (None: no
    rule-based or service reward). ``cfg`` is a ScorerConfig or None (defaults: a direct ``Scoring``)."""
    policy = cfg.call_policy if cfg is not None else CallPolicy()
    fns: dict[str, tuple[Callable, str | None, int | None]] = {}  # key -> (callable, name, batch size)
    fixed: list[Term] = []
    if reward_fn is not None:
        fns["reward_fn"] = (reward_fn, None, None)
        fixed.append(("reward_fn", reward_fn_weight))
    if router is not None:
        fns.update({name: (fn, getattr(fn, "__qualname__", name), None) for name, fn in router.fns.items()})
    if cfg is not None and cfg.reward_url is not None:
        fns["reward_server"] = (_http_client(cfg), None, cfg.reward_url_batch_size or cfg.batch_size)
        fixed.append(("reward_server", cfg.reward_url_weight))
    if cfg is not None and cfg.judge is not None:
        fns["judge"] = (_judge(cfg), None, None)
        fixed.append(("judge", cfg.judge.weight))
    if not fns:
        return None
    executor = CallExecutor()  # one loop and one pool for all of them; each reward bounded by its own caller
    callers = {key: RewardCaller(fn, policy, name=name, batch_size=size, executor=executor)
               for key, (fn, name, size) in fns.items()}
    return RewardServices(callers, tuple(fixed), router, cfg.on_reward_error if cfg is not None else "dead_letter",
                          router.routes.by if router is not None else "data_source", executor=executor)


def _http_client(cfg: Any) -> Any:
    """The reward server's client, after a start-up probe (``GET /health``, or the reward path itself for a server
    without ``/health``, as OpenRLHF's ``serve_rm.py``: logged as a warning, since its health cannot be checked)."""
    from stream_rl.rewards.http import HttpRewardClient, check_reachable

    try:
        health_checked, note = check_reachable(cfg.reward_url, timeout_s=min(cfg.reward_timeout_s, 10.0))
        (log.info if health_checked else log.warning)(note)
        # the caller's deadline (reward_timeout_s) decides a call's fate; the client's own, a second later, only
        # frees the abandoned thread: with equal deadlines a slow server's call was retried when the client's fired first
        return HttpRewardClient(cfg.reward_url, timeout_s=cfg.reward_timeout_s + 1.0,
                                headers_env=cfg.reward_headers_env)
    except ValueError as exc:  # one line naming scorer.reward_url (or the missing variable), exit 2
        raise RewardFnError(str(exc)) from None


def _judge(cfg: Any) -> Any:
    from stream_rl.rewards.judge import JudgeReward

    try:  # scorer.judge is a JudgeSettings (and its weight); the exchange's deadline is the reward call's
        return JudgeReward(cfg.judge, timeout_s=cfg.reward_timeout_s)
    except ValueError as exc:
        raise RewardFnError(f"scorer.judge: {exc}") from None


def service_rewards(rollouts: Sequence[Rollout], services: RewardServices, skip: Mapping[int, Any],
                    on_wait: Callable[[], None] | None = None
                    ) -> tuple[dict[int, RoutedReward], dict[int, tuple[str, str]]]:
    """Rewards of the rollouts not in ``skip``: ``({i: RoutedReward}, {i: (reason, error_type)})``."""
    failures: dict[int, tuple[str, str]] = {}
    plans: dict[int, tuple[Term, ...]] = {}
    for i, rollout in enumerate(rollouts):
        if i in skip:
            continue
        try:
            plans[i] = services.terms_for(rollout)
        except UnroutedError as exc:
            failures[i] = (str(exc), "UnroutedError")
    by_reward: dict[str, list[int]] = defaultdict(list)
    for i, terms in plans.items():
        for name, _ in terms:
            by_reward[name].append(i)
    futures = {name: services.callers[name].submit([_request(rollouts[i]) for i in idxs])
               for name, idxs in by_reward.items()}
    _wait(list(futures.values()), on_wait)
    outcome: dict[tuple[int, str], CallOutcome] = {}
    for name, idxs in by_reward.items():
        for i, o in zip(idxs, futures[name].result(), strict=True):
            outcome[(i, name)] = o
            services.stats.seen[(name, rollouts[i].metadata.get(services.data_key, "none"))].append(o)
    rewards: dict[int, RoutedReward] = {}
    for i, terms in plans.items():
        result = _combine(i, rollouts[i], terms, outcome, services)
        if isinstance(result, RoutedReward):
            rewards[i] = result
        else:
            failures[i] = result
    return rewards, failures


def _request(r: Rollout) -> RewardRequest:
    return RewardRequest(r.prompt_text, r.response_text, r.answer, r.metadata, r.response_length)


def _wait(futures: list[concurrent.futures.Future], on_wait: Callable[[], None] | None) -> None:
    pending = set(futures)
    while pending:
        _, pending = concurrent.futures.wait(pending, timeout=1.0)
        if pending and on_wait is not None:
            on_wait()


def _combine(i: int, rollout: Rollout, terms: tuple[Term, ...], outcome: Mapping[tuple[int, str], CallOutcome],
             services: RewardServices) -> RoutedReward | tuple[str, str]:
    outputs: list[RewardOutput] = []
    for name, _ in terms:
        o = outcome[(i, name)]
        if o.ok:
            outputs.append(o.output)
        elif services.on_error == "zero":
            services.stats.zeroed[(name, rollout.metadata.get(services.data_key, "none"))] += 1
            outputs.append(RewardOutput(0.0))
        else:
            reason = o.reason if name == "reward_fn" else f"reward {name!r}: {o.reason}"
            return reason, o.error_type or "RewardValueError"
    components = {name: weight * out.reward for (name, weight), out in zip(terms, outputs)}
    tokens = None
    if any(out.token_rewards is not None for out in outputs):
        tokens = np.zeros(rollout.response_length, dtype=np.float64)  # [R]
        for (_, weight), out in zip(terms, outputs):
            if out.token_rewards is not None:
                tokens += weight * out.token_rewards.astype(np.float64)
            else:
                tokens[-1] += weight * out.reward
    return RoutedReward(float(sum(components.values())), components, tokens)
