"""One executor for a scorer's rewards (issue 44.1): one event-loop thread and one lazily grown pool shared by
every reward, each reward still bounded by its own caller; a hung reward neither starves nor times out another;
exact thread counts on real threads."""

from __future__ import annotations

import threading
import time

from consumers.scorer.services import build_services
from stream_rl.rewards.calls import CallExecutor, CallPolicy, DaemonPool, RewardCaller, RewardRequest
from stream_rl.rewards.routing import RewardRouter, RewardRoutes, RewardTerm


def requests(n: int) -> list[RewardRequest]:
    return [RewardRequest(f"p{i}", f"r{i}", str(i), {"i": str(i)}) for i in range(n)]


def _threads(name: str) -> int:
    """Live threads named exactly ``name`` (each test names its executor: other tests' threads never count)."""
    return sum(t.name == name for t in threading.enumerate())


def _wait(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_six_rewards_share_one_loop_and_only_the_threads_they_used():
    policy = CallPolicy(timeout_s=5.0, concurrency=8, max_retries=0)
    with CallExecutor("reward-calls-t6") as executor:  # its loop thread: reward-calls-t6; its pool's: reward-call-t6
        callers = [RewardCaller(lambda p, r, a, m, k=k: float(k), policy, name=f"r{k}", executor=executor)
                   for k in range(6)]
        for k, caller in enumerate(callers):  # one reward at a time, as a routed batch of one data source
            assert [o.output.reward for o in caller.call(requests(16))] == [float(k)] * 16
        assert _threads("reward-calls-t6") == 1  # one loop for all six (was six)
        assert executor.pool.threads <= 8  # at most one reward's 8 calls were ever in flight (was 6 x 8 = 48)
        for caller in callers:
            caller.close()  # a shared executor outlives its callers
        assert executor.loop.is_running()
    assert _wait(lambda: _threads("reward-call-t6") == 0)  # closing the executor ends them all


def test_each_reward_keeps_its_own_bound_on_the_shared_executor():
    from support.slow_rewards import overlap_counted

    counted, state = overlap_counted(0.02)

    with CallExecutor("reward-calls-bound") as executor:
        caller = RewardCaller(counted, CallPolicy(timeout_s=5.0, concurrency=3, max_retries=0), executor=executor)
        assert all(o.ok for o in caller.call(requests(24)))
    assert state["peak"] == 3


def test_a_hung_reward_neither_starves_nor_times_out_another():
    release = threading.Event()

    def hangs(prompt, response, answer, metadata):
        release.wait(30)
        return 0.0

    fast_policy = CallPolicy(timeout_s=1.0, concurrency=4, max_retries=0)
    with CallExecutor("reward-calls-hang") as executor:
        hung = RewardCaller(hangs, CallPolicy(timeout_s=3.0, concurrency=4, max_retries=0), executor=executor)
        fast = RewardCaller(lambda p, r, a, m: 1.0, fast_policy, name="fast", executor=executor)
        pending = hung.submit(requests(4))  # all four of its slots hang (for up to 3 s)
        assert _wait(lambda: executor.pool.threads == 4)
        start = time.perf_counter()
        outcomes = fast.call(requests(8))  # new threads serve it: nothing waits behind the hung calls
        assert all(o.ok for o in outcomes) and time.perf_counter() - start < 1.0
        assert all(o.timed_out for o in pending.result(timeout=10))
        release.set()


def test_a_lazy_pool_starts_a_thread_only_when_every_thread_is_busy():
    pool = DaemonPool(0, "lazy-t", lazy=True)
    assert pool.threads == 0
    for _ in range(50):  # one call at a time: the first call's thread serves them all
        assert pool.submit(lambda: 1, ()).result(timeout=5) == 1
    assert pool.threads == 1
    gate = threading.Event()
    busy = [pool.submit(gate.wait, (10,)) for _ in range(3)]  # three at once: two more threads
    assert _wait(lambda: pool.threads == 3)
    gate.set()
    assert all(f.result(timeout=5) for f in busy)
    pool.close()
    assert _wait(lambda: pool.threads == 0)


def test_a_scorers_services_run_every_reward_on_one_executor():
    router = RewardRouter.load(RewardRoutes(by="data_source", routes={"math": (RewardTerm("math_boxed"),),
                                                                      "mc": (RewardTerm("multiple_choice"),)}))
    services = build_services(None, reward_fn=lambda p, r, a, m: 1.0, router=router)
    try:
        executors = {id(c.executor) for c in services.callers.values()}
        assert executors == {id(services.executor)} and len(services.callers) == 3
    finally:
        services.close()
    assert not services.executor.loop.is_running() or _wait(lambda: not services.executor.loop.is_running())
