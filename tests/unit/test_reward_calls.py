"""Reward calls (stream_rl.rewards.calls): deadlines, bounded concurrency, async and batch functions, retries of
retriable errors only, with exact counts of calls and attempts, on real functions (slow, hanging, flaky,
raising)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from stream_rl.rewards.calls import (
    CallPolicy,
    DaemonPool,
    RetriableRewardError,
    RewardCaller,
    RewardRequest,
    backoff_delay,
    batched,
    is_retriable,
)

FAST = CallPolicy(timeout_s=2.0, concurrency=4, max_retries=2, backoff_s=0.01, max_backoff_s=0.02)


def requests(n: int) -> list[RewardRequest]:
    return [RewardRequest(f"p{i}", f"r{i}", str(i), {"i": str(i)}, response_length=2) for i in range(n)]


def length_reward(prompt, response, answer, metadata):
    return float(len(response)) + float(metadata["i"])


def test_per_rollout_function_in_order():
    with RewardCaller(length_reward, FAST) as caller:
        outcomes = caller.call(requests(5))
    assert [o.output.reward for o in outcomes] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert all(o.ok and o.attempts == 1 and o.retries == 0 and o.reason is None for o in outcomes)


def test_async_function():
    async def reward(prompt, response, answer, metadata):
        await asyncio.sleep(0.01)
        return {"reward": 0.5, "token_rewards": [0.25, 0.25]}

    with RewardCaller(reward, FAST) as caller:
        outcomes = caller.call(requests(3))
    assert [o.output.reward for o in outcomes] == [0.5] * 3
    assert outcomes[0].output.token_rewards.tolist() == [0.25, 0.25]


def test_batch_function_called_once_per_chunk():
    calls: list[int] = []

    @batched
    def reward(prompts, responses, answers, metadatas):
        calls.append(len(prompts))
        return [float(a) * 10 for a in answers]

    with RewardCaller(reward, FAST, batch_size=3) as caller:
        outcomes = caller.call(requests(7))
    assert sorted(calls) == [1, 3, 3]
    assert [o.output.reward for o in outcomes] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0]


def test_async_batch_wrong_count_fails_every_rollout_of_the_call():
    @batched
    async def reward(prompts, responses, answers, metadatas):
        return [1.0]

    with RewardCaller(reward, FAST) as caller:
        outcomes = caller.call(requests(3))
    assert [o.ok for o in outcomes] == [False] * 3
    assert "returned 1 rewards for 3 rollouts" in outcomes[0].reason


def test_hanging_function_times_out_and_others_go_on():
    release = threading.Event()

    def reward(prompt, response, answer, metadata):
        if prompt == "p1":
            release.wait(30)  # hangs until the test ends
        return 1.0

    policy = CallPolicy(timeout_s=0.3, concurrency=2, max_retries=3, backoff_s=0.01, max_backoff_s=0.01)
    start = time.perf_counter()
    with RewardCaller(reward, policy) as caller:
        outcomes = caller.call(requests(6))
    elapsed = time.perf_counter() - start
    release.set()
    assert [o.ok for o in outcomes] == [True, False, True, True, True, True]
    assert outcomes[1].timed_out and outcomes[1].attempts == 1  # a timeout is not retried
    assert "timed out after 0.3 s" in outcomes[1].reason
    assert elapsed < 2.0


def test_a_hung_call_holds_only_its_own_thread_and_the_pool_keeps_its_free_threads():
    release, names = threading.Event(), []

    def reward(prompt, response, answer, metadata):
        names.append(threading.current_thread().name)
        if prompt == "p0":
            release.wait(30)
        return 1.0

    policy = CallPolicy(timeout_s=0.3, concurrency=2, max_retries=0)
    with RewardCaller(reward, policy, name="hang") as caller:
        first = caller.call(requests(1))
        assert first[0].timed_out and caller._pool.threads == 3  # the hung one + 2 free
        again = caller.call(requests(5)[1:])  # both free threads serve, the hung one keeps hanging
        assert all(o.ok for o in again)
        release.set()
        deadline = time.monotonic() + 5
        while caller._pool.threads != 2 and time.monotonic() < deadline:  # the hung thread ended once released
            time.sleep(0.01)
        assert caller._pool.threads == 2
        assert all(o.ok for o in caller.call(requests(4)))
    assert set(names) == {"reward-call-hang"} and len(names) == 9  # every call on the pool's threads


def test_the_pool_reuses_its_threads_and_an_abandoned_finished_job_starts_nothing():
    pool = DaemonPool(2, "t")
    seen = {pool.submit(lambda: threading.get_ident(), ()).result(timeout=5) for _ in range(50)}
    assert len(seen) <= 2 and pool.threads == 2  # 50 calls, at most 2 threads: none started per call
    done = pool.submit(lambda: 1, ())
    assert done.result(timeout=5) == 1
    pool.abandon(done)  # it returned before its deadline was noticed: nothing to replace
    assert pool.threads == 2
    pool.close()
    deadline = time.monotonic() + 5
    while pool.threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.threads == 0


def test_concurrency_is_bounded_and_used():
    from support.slow_rewards import overlap_counted

    reward, state = overlap_counted(0.1)
    policy = CallPolicy(timeout_s=5.0, concurrency=3, max_retries=0)
    start = time.perf_counter()
    with RewardCaller(reward, policy) as caller:
        outcomes = caller.call(requests(9))
    elapsed = time.perf_counter() - start
    assert all(o.ok for o in outcomes)
    assert state["peak"] == 3
    assert 0.29 < elapsed < 0.9  # 3 waves of 0.1 s, not 9


def test_flaky_retriable_function_succeeds_after_exact_retries():
    attempts: dict[str, int] = {}

    def reward(prompt, response, answer, metadata):
        attempts[prompt] = attempts.get(prompt, 0) + 1
        if attempts[prompt] < 3:
            raise RetriableRewardError("busy")
        return 1.0

    with RewardCaller(reward, FAST) as caller:
        outcomes = caller.call(requests(2))
    assert attempts == {"p0": 3, "p1": 3}
    assert [(o.ok, o.attempts, o.retries) for o in outcomes] == [(True, 3, 2)] * 2


def test_retriable_error_past_the_bound_fails_with_reason():
    count = {"n": 0}

    class ServerBusy(Exception):
        retriable = True

    def reward(prompt, response, answer, metadata):
        count["n"] += 1
        raise ServerBusy("503")

    with RewardCaller(reward, FAST) as caller:
        [outcome] = caller.call(requests(1))
    assert count["n"] == 3  # 1 + max_retries
    assert outcome.attempts == 3 and not outcome.ok
    assert outcome.reason == "reward function test_retriable_error_past_the_bound_fails_with_reason.<locals>.reward " \
                             "raised ServerBusy: 503 (after 3 attempts)"


def test_non_retriable_error_is_not_retried():
    count = {"n": 0}

    def reward(prompt, response, answer, metadata):
        count["n"] += 1
        raise KeyError("label")

    with RewardCaller(reward, FAST, name="my_reward") as caller:
        [outcome] = caller.call(requests(1))
    assert count["n"] == 1
    assert outcome.reason == "reward function my_reward raised KeyError: 'label'"


def test_bad_values_are_reasons():
    def reward(prompt, response, answer, metadata):
        return {"0": float("nan"), "1": "high", "2": {"rewards": 1.0}}[answer]

    with RewardCaller(reward, FAST, name="f") as caller:
        outcomes = caller.call(requests(3))
    assert [o.reason for o in outcomes] == ["f returned a non-finite reward nan",
                                            "f returned str, expected a float or a dict with 'reward'",
                                            "f returned a dict with unknown keys ['rewards']; allowed: "
                                            "['reward', 'token_rewards']"]


def test_backoff_is_doubling_and_bounded():
    assert [backoff_delay(k, 0.5, 3.0) for k in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        backoff_delay(0, 0.5, 3.0)


def test_retriable_marker_and_policy_bounds():
    assert is_retriable(RetriableRewardError()) and not is_retriable(ValueError())
    with pytest.raises(ValueError):
        CallPolicy(concurrency=0)
    with pytest.raises(ValueError):
        CallPolicy(backoff_s=2.0, max_backoff_s=1.0)


def test_submit_returns_while_calls_are_in_flight():
    gate = threading.Event()

    def reward(prompt, response, answer, metadata):
        gate.wait(5)
        return 1.0

    with RewardCaller(reward, FAST) as caller:
        future = caller.submit(requests(2))
        time.sleep(0.05)
        assert not future.done()
        gate.set()
        assert [o.ok for o in future.result(timeout=5)] == [True, True]
