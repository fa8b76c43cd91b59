"""The slow reward service of benchmark 17 (:mod:`bench.trl_slow`), stream-rl's side: the demo's verifier behind a
service whose every call takes a fixed time, as an LLM judge, a sandbox or a reward-model server does.

Consumes: ``SRL_BENCH_REWARD_DELAY_S`` (seconds per call, read at each call; unset: 0), set by the benchmark on the
``stream-rl run`` it starts and inherited by its scorer.
Produces: :func:`delayed_addition`, a batched reward function (``scorer.reward_fn``): one call per scorer batch
waits the delay once, then scores every rollout with :func:`stream_rl.demo.task.addition_reward`. TRL's side
(:func:`bench.trl_worker.delayed`) waits the same delay once per reward call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from stream_rl.demo.task import addition_reward

DELAY_ENV = "SRL_BENCH_REWARD_DELAY_S"
DELAYED_REWARD = "bench.delayed_reward:delayed_addition"


def delay_s() -> float:
    return float(os.environ.get(DELAY_ENV) or 0.0)


def delayed_addition(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
                     metadatas: Sequence[dict]) -> list[float]:
    """Wait :func:`delay_s` once, then the demo's verifier on every rollout of the batch."""
    time.sleep(delay_s())
    return [addition_reward(p, r, a, m) for p, r, a, m in zip(prompts, responses, answers, metadatas, strict=True)]


delayed_addition.batched = True  # type: ignore[attr-defined]  (stream-rl's batched reward marker)
