"""Benchmark 11, reward calls: one scorer's rollouts/s against a reward server that answers in 100 ms, as
``scorer.reward_concurrency`` grows.

Consumes: nothing from the broker (the scorer's step is measured where the reward calls happen: the pure
:func:`consumers.scorer.scoring.score_rollouts` with ``scorer.reward_url``).
Produces: per round (variants interleaved, at least 3 rounds), for each concurrency ``c``: the rollouts/s of
scoring ``N`` synthetic rollouts, one request per rollout (``reward_url_batch_size = 1``), against a real
:class:`stream_rl.rewards.server.RewardServer` on 127.0.0.1 whose reward sleeps ``LATENCY_S`` and serves up to
``SERVER_PARALLEL`` requests at once (the server's own limit). Figures: the medians, and for each ``c > 1`` the
speed-up over ``c = 1`` and its efficiency (speed-up / c; the issue's target is >= 0.8 up to the server's limit).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bench.common import BenchContext, fmt, interleave, medians

TITLE = "Reward calls"
LATENCY_S = 0.1
SERVER_PARALLEL = 64
CONCURRENCY = (1, 4, 16)


def slow_reward(prompt: str, response: str, answer: str | None, metadata: dict) -> float:
    """The benchmark's reward: 100 ms of waiting (a remote model's latency), then the response's length."""
    time.sleep(LATENCY_S)
    return float(len(response))


def _rollouts(n: int) -> list:
    import numpy as np

    from schemas import Rollout, group_id_for, rollout_id_for

    out = []
    for i in range(n):
        prompt_id, sample = f"b{i // 4}", i % 4
        out.append(Rollout(
            rollout_id=rollout_id_for(prompt_id, 0, sample), prompt_id=prompt_id, epoch=0,
            group_id=group_id_for(prompt_id, 0), sample_index=sample, group_size=4,
            prompt_token_ids=np.array([1, 5, 6], dtype=np.int32), response_token_ids=np.array([7, 8, 2], np.int32),
            behavior_logprobs=np.full(3, -0.5, dtype=np.float32), token_policy_versions=np.zeros(3, np.int64),
            finish_reason="stop", producer_id="bench", prompt_text="3+4=", response_text="7", answer="7",
            metadata={"data_source": "bench"}, temperature=1.0))
    return out


def run(ctx: BenchContext) -> dict[str, Any]:
    from consumers.scorer.config import ScorerConfig
    from consumers.scorer.scoring import Scoring, score_rollouts
    from consumers.scorer.services import build_services
    from stream_rl.rewards.server import RewardServer, per_rollout_scorer

    n = ctx.pick(full=64, quick=32, tiny=16)
    rollouts = _rollouts(n)
    server = RewardServer(per_rollout_scorer(slow_reward, "slow_reward"), name="slow_reward", batch_size=1,
                          parallel=SERVER_PARALLEL)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = server.url
    try:
        def variant(c: int):
            def measure() -> dict[str, float]:
                cfg = ScorerConfig(reward_fn=None, reward_url=url, reward_url_batch_size=1, reward_concurrency=c,
                                   batch_size=n, reward_timeout_s=30)
                services = build_services(cfg, reward_fn=None, router=None)
                try:
                    start = time.perf_counter()
                    out = score_rollouts(rollouts, Scoring("bench-scorer", services=services))
                    seconds = time.perf_counter() - start
                finally:
                    services.close()
                if any(not hasattr(o, "reward") for o in out):
                    raise RuntimeError(f"a reward call failed: {[o for o in out if not hasattr(o, 'reward')][:1]}")
                return {f"c{c}_rollouts_s": n / seconds}
            return measure

        samples = interleave([(f"concurrency {c}", variant(c)) for c in CONCURRENCY], max(ctx.repeats, 3)
                             if ctx.mode == "full" else ctx.min_rounds, ctx.log, ctx.min_rounds)
    finally:
        server.shutdown()
        server.server_close()
    med = medians(samples)
    figures = dict(med)
    for c in CONCURRENCY[1:]:
        figures[f"c{c}_speedup"] = med[f"c{c}_rollouts_s"] / med["c1_rollouts_s"]
        figures[f"c{c}_efficiency"] = figures[f"c{c}_speedup"] / c
    return {"figures": figures, "samples": samples,
            "params": {"rollouts": n, "latency_s": LATENCY_S, "server_parallel": SERVER_PARALLEL,
                       "concurrency": list(CONCURRENCY)},
            "notes": [f"{n} rollouts per measurement, one request per rollout, server latency {LATENCY_S * 1000:.0f} "
                      f"ms, server limit {SERVER_PARALLEL} requests at once."]}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    f = result["figures"]
    latency = result.get("params", {}).get("latency_s", LATENCY_S)
    rows = [[str(c), fmt(f[f"c{c}_rollouts_s"]), fmt(c / latency), fmt(f.get(f"c{c}_speedup", 1.0)),
             fmt(f.get(f"c{c}_efficiency", 1.0))] for c in CONCURRENCY]
    return ["reward_concurrency", "rollouts/s", f"ideal (c / {latency * 1000:.0f} ms)", "speed-up vs 1",
            "efficiency (speed-up / c)"], rows


def headline(result: dict[str, Any]) -> str:
    f = result["figures"]
    top = CONCURRENCY[-1]
    return (f"{fmt(f[f'c{top}_speedup'])}x rollouts/s at reward_concurrency {top} against 1 "
            f"(efficiency {fmt(f[f'c{top}_efficiency'])}; 100 ms reward server)")
