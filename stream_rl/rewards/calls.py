"""Calling reward functions as services: a deadline per attempt, bounded concurrency, ``async def`` and batch
functions, bounded retries of retriable errors only.

Consumes: a reward callable in one of four shapes and a batch of :class:`RewardRequest` (one per rollout)::

    per rollout  fn(prompt, response, answer, metadata)            -> float | dict   (the scorer's contract)
    async        async def fn(prompt, response, answer, metadata)  -> float | dict
    batch        fn(prompts, responses, answers, metadatas)        -> [float | dict] (one per rollout, in order)
    async batch  async def fn(prompts, responses, answers, metadatas) -> [float | dict]

A batch function is marked with :func:`batched` (or any ``fn.batched = True``); async is detected
(``inspect.iscoroutinefunction``).
Produces: one :class:`CallOutcome` per request, in order: the checked :class:`RewardOutput`, or the reason it has
none (the scorer dead-letters that rollout, or scores it 0 when ``scorer.on_reward_error = "zero"``, counted),
with the attempts made, the retries and the latency.
Guarantees:
- At most ``concurrency`` calls are in flight at once (a batch call counts as one).
- Each attempt has a deadline of ``timeout_s``; a call past it is abandoned (its thread, if any, is left to end
  on its own, as a daemon; it no longer holds a concurrency slot) and its rollouts fail with
  ``reward call timed out after {timeout_s} s``. A timed-out call is not retried: the deadline is the budget.
- An exception is retried only when it is marked retriable (:func:`is_retriable`: ``exc.retriable is True``, as
  :class:`RetriableRewardError` and the HTTP client's errors are), at most ``max_retries`` times, after waiting
  ``backoff_delay(k) = min(max_backoff_s, backoff_s * 2**(k-1))`` before retry ``k`` (k = 1, 2, ...). Any other
  exception, or the last retriable one, fails the call with its type and message as the reason.
- Values go through :func:`stream_rl.rewards.contract.check_reward_value` (finite, known keys, token rewards of
  the right length); a batch function's list of the wrong length fails all its rollouts with that reason; an
  ``Exception`` instance in a batch function's list fails that rollout alone, with its message as the reason.
- Nothing raises out of :meth:`RewardCaller.call` for a per-rollout problem; it never returns fewer outcomes
  than requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stream_rl.rewards.contract import RewardOutput, RewardValueError, check_reward_value, error_text
from stream_rl.rewards.settings import CallPolicy  # declared there once (the scorer's section holds the same fields)


class RetriableRewardError(RuntimeError):
    """Raise this (or any exception with ``retriable = True``) from a reward function to ask for a retry."""

    retriable = True


def batched(fn: Callable) -> Callable:
    """Mark ``fn`` as a batch reward function: lists in (prompts, responses, answers, metadatas), a list out."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


def is_batched(fn: Callable) -> bool:
    return getattr(fn, "batched", False) is True


def is_retriable(exc: BaseException) -> bool:
    """True when ``exc`` (or the exception it was raised from) says it may succeed if tried again."""
    return getattr(exc, "retriable", False) is True


def backoff_delay(retry: int, backoff_s: float, max_backoff_s: float) -> float:
    """Seconds to wait before retry ``retry`` (1-based): ``min(max_backoff_s, backoff_s * 2**(retry-1))``."""
    if retry < 1:
        raise ValueError(f"retry is 1-based, got {retry}")
    return min(max_backoff_s, backoff_s * 2 ** (retry - 1))


@dataclass(frozen=True)
class RewardRequest:
    """One rollout's inputs to a reward function; ``response_length`` checks token rewards."""

    prompt: str
    response: str
    answer: str | None
    metadata: Mapping[str, str] = field(default_factory=dict)
    response_length: int = 0


@dataclass(frozen=True)
class CallOutcome:
    """A rollout's reward (``output``) or why it has none (``reason``), with what it took to get there."""

    output: RewardOutput | None
    reason: str | None
    attempts: int
    latency_s: float
    timed_out: bool = False
    error_type: str | None = None  # the exception's type name, "RewardValueError" (bad value) or "Timeout"

    @property
    def ok(self) -> bool:
        return self.output is not None

    @property
    def retries(self) -> int:
        return max(0, self.attempts - 1)


class _CallFailed(Exception):
    def __init__(self, reason: str, attempts: int, timed_out: bool = False, error_type: str = "RewardValueError"):
        super().__init__(reason)
        self.reason, self.attempts, self.timed_out, self.error_type = reason, attempts, timed_out, error_type


class CallExecutor:
    """One event-loop thread and one pool of daemon threads for sync calls, shared by a scorer's rewards.

    Each reward stays bounded by its own :class:`RewardCaller` (``concurrency`` calls in flight); the shared pool
    starts a thread only when every thread it has is busy (``lazy``), so it holds at most as many threads as
    calls were ever in flight at once across the rewards, never one per configured slot, and a sync call never
    waits behind another reward's calls for a thread (its deadline starts when it has one). Before, every
    reward had an event-loop thread and ``concurrency`` pool threads of its own (6 loops and 48 threads for six
    rewards at the default 8)."""

    def __init__(self, name: str = "reward-calls", pool_size: int | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        # pool_size: a private executor's pool of that many threads, started now (RewardCaller without executor)
        self.pool = DaemonPool(pool_size or 0, name.replace("reward-calls", "reward-call"), lazy=pool_size is None)
        weakref.finalize(self, self.loop.call_soon_threadsafe, self.loop.stop)  # an unclosed executor's thread ends
        weakref.finalize(self, self.pool.close)  # and its pool's idle threads

    def close(self) -> None:
        """Stop the loop thread and the pool's idle threads (calls still in flight are abandoned)."""
        self.pool.close()
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> CallExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RewardCaller:
    """Runs one reward callable under a :class:`CallPolicy` on a :class:`CallExecutor`: a scorer's shared one,
    or (``executor`` None) one of its own, closed with it.

    ``call(requests)`` blocks until every outcome is known (at most about ``(max_retries + 1) * timeout_s`` plus
    the backoffs); ``submit(requests)`` returns a ``concurrent.futures.Future`` of the same list so that the
    caller can go on (heartbeat, commit what is done) while calls are in flight.
    """

    def __init__(self, fn: Callable, policy: CallPolicy = CallPolicy(), *, name: str | None = None,
                 batch_size: int | None = None, executor: CallExecutor | None = None) -> None:
        self.fn, self.policy = fn, policy
        self.name = name or getattr(fn, "__qualname__", repr(fn))
        self.batch = is_batched(fn)
        self.batch_size = batch_size
        sync = not inspect.iscoroutinefunction(fn)
        self._own = executor is None
        self.executor = executor if executor is not None else CallExecutor(
            f"reward-calls-{self.name}", pool_size=policy.concurrency if sync else 0)
        self._loop = self.executor.loop
        self._slots = asyncio.Semaphore(policy.concurrency)  # this reward's bound, on the shared loop
        self._pool = self.executor.pool if sync else None

    def submit(self, requests: Sequence[RewardRequest]) -> concurrent.futures.Future[list[CallOutcome]]:
        return asyncio.run_coroutine_threadsafe(self._call_all(list(requests)), self._loop)

    def call(self, requests: Sequence[RewardRequest]) -> list[CallOutcome]:
        return self.submit(requests).result()

    def close(self) -> None:
        """Close the executor when it is this caller's own (a shared one is closed by its owner)."""
        if self._own:
            self.executor.close()

    def __enter__(self) -> RewardCaller:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def _call_all(self, requests: list[RewardRequest]) -> list[CallOutcome]:
        if self.batch:
            size = self.batch_size or max(1, len(requests))
            chunks = [requests[i:i + size] for i in range(0, len(requests), size)]
        else:
            chunks = [[r] for r in requests]
        results = await asyncio.gather(*(self._call_chunk(chunk) for chunk in chunks))
        return [outcome for chunk in results for outcome in chunk]

    async def _call_chunk(self, chunk: list[RewardRequest]) -> list[CallOutcome]:
        start = time.perf_counter()
        try:
            values, attempts = await self._with_retries(chunk)
        except _CallFailed as failed:
            latency = time.perf_counter() - start
            return [CallOutcome(None, failed.reason, failed.attempts, latency, failed.timed_out, failed.error_type)
                    for _ in chunk]
        latency = time.perf_counter() - start
        return [self._checked(value, request, attempts, latency) for value, request in zip(values, chunk)]

    def _checked(self, value: Any, request: RewardRequest, attempts: int, latency: float) -> CallOutcome:
        if isinstance(value, Exception):  # a batch function's per-rollout failure (e.g. a reward server's error)
            return CallOutcome(None, error_text(value, limit=2000), attempts, latency,
                               error_type=type(value).__name__)
        try:
            return CallOutcome(check_reward_value(value, request.response_length, self.name), None, attempts, latency)
        except RewardValueError as exc:
            return CallOutcome(None, str(exc), attempts, latency, error_type="RewardValueError")

    async def _with_retries(self, chunk: list[RewardRequest]) -> tuple[list[Any], int]:
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._attempt(chunk), attempt
            except _CallFailed as failed:
                failed.attempts = attempt
                raise
            except Exception as exc:  # user code failed: retried only when it says it may succeed later
                if not is_retriable(exc) or attempt > self.policy.max_retries:
                    tail = f" (after {attempt} attempts)" if attempt > 1 else ""
                    raise _CallFailed(f"reward function {self.name} raised {type(exc).__name__}: {exc}{tail}",
                                      attempt, error_type=type(exc).__name__) from exc
            await asyncio.sleep(backoff_delay(attempt, self.policy.backoff_s, self.policy.max_backoff_s))

    async def _attempt(self, chunk: list[RewardRequest]) -> list[Any]:
        async with self._slots:
            awaitable, job = self._invoke(chunk)
            try:
                values = await asyncio.wait_for(awaitable, self.policy.timeout_s)
            except asyncio.TimeoutError:
                if job is not None:
                    self._pool.abandon(job)  # its thread still runs the call: another one takes its place
                raise _CallFailed(f"reward call to {self.name} timed out after {self.policy.timeout_s:g} s", 0,
                                  timed_out=True, error_type="Timeout") from None
        if not self.batch:
            return [values]
        if not isinstance(values, Sequence) or isinstance(values, str | bytes | Mapping):
            raise _CallFailed(f"batch reward function {self.name} returned {type(values).__name__}, expected a "
                              f"list of {len(chunk)} rewards", 0)
        if len(values) != len(chunk):
            raise _CallFailed(f"batch reward function {self.name} returned {len(values)} rewards for "
                              f"{len(chunk)} rollouts", 0)
        return list(values)

    def _invoke(self, chunk: list[RewardRequest]) -> tuple[Any, concurrent.futures.Future | None]:
        """An awaitable of the function's value on ``chunk`` (a coroutine, or a sync call on a thread of the daemon
        pool, whose job is returned too)."""
        if self.batch:
            args: tuple = ([r.prompt for r in chunk], [r.response for r in chunk], [r.answer for r in chunk],
                           [dict(r.metadata) for r in chunk])
        else:
            one = chunk[0]
            args = (one.prompt, one.response, one.answer, dict(one.metadata))
        if self._pool is None:  # an async function: awaited on the loop itself
            return self.fn(*args), None
        job = self._pool.submit(self.fn, args)
        return asyncio.wrap_future(job), job


class DaemonPool:
    """Daemon threads that run sync reward calls: ``size`` of them started now and kept free for new work, or
    (``lazy``) none at first and one more whenever a call comes and every thread is busy (then the callers
    bound the calls in flight, each with its own semaphore, and the pool never makes one wait).

    A fresh thread per call cost more CPU than the demo's verifier itself (found by the elastic-cores benchmark,
    since removed, docs/architecture.md: the scorer's CPU per step fell by a third with this pool). The guarantee
    a fresh thread gave is kept: a hung call holds only its own thread (a daemon, so never the process's exit);
    :meth:`abandon` (a call past its deadline) lets the abandoned call's thread end once the call returns, and
    starts a replacement now (``lazy``: the next call that finds no idle thread starts one), so ``size`` threads
    stay free."""

    def __init__(self, size: int, name: str = "reward-call", *, lazy: bool = False):
        self.size, self.name, self.lazy = size, name, lazy
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned: set[concurrent.futures.Future] = set()
        self._threads = 0  # alive workers, those running an abandoned call included
        self._idle = 0  # lazy: workers waiting for a job that no submitted job has claimed yet
        for _ in range(0 if lazy else size):
            self._start()

    def _start(self, claimed: bool = False) -> None:
        """A new worker; ``claimed``: started for a job just submitted (it does not count idle for that one)."""
        with self._lock:
            self._threads += 1
        threading.Thread(target=self._work, args=(claimed,), name=self.name, daemon=True).start()

    def submit(self, fn: Callable, args: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.lazy:
            with self._lock:
                claimed = self._idle > 0
                if claimed:
                    self._idle -= 1
            if not claimed:
                self._start(claimed=True)
        self._jobs.put((future, fn, args))
        return future

    def abandon(self, future: concurrent.futures.Future) -> None:
        """``future``'s call ran past its deadline: unless it has just finished, its thread ends when the call
        returns, and (unless ``lazy``) a new thread takes its place now."""
        with self._lock:
            if future.done():
                return
            self._abandoned.add(future)
        if not self.lazy:
            self._start()

    def close(self) -> None:
        """Let every idle worker end (one running a call ends when the call returns)."""
        with self._lock:
            count = self._threads
        for _ in range(count):
            self._jobs.put(None)

    @property
    def threads(self) -> int:
        with self._lock:
            return self._threads

    def _work(self, claimed: bool = False) -> None:
        """Run jobs until ``close``; a lazy pool's worker counts itself idle before it hands a result back, so
        the call its caller makes next finds it free instead of starting a thread."""
        job = self._next(claimed)
        while job is not None:
            future, fn, args = job
            running = future.set_running_or_notify_cancel()
            result: Any = None
            error: BaseException | None = None
            if running:
                try:
                    result = fn(*args)
                except BaseException as exc:  # handed to the caller, who decides (retry, reason)
                    error = exc
            with self._lock:
                leaving = future in self._abandoned  # a replacement took this thread's place
                self._abandoned.discard(future)
                if self.lazy and not leaving:
                    self._idle += 1
            if running:
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            if leaving:
                break
            job = self._next(claimed=True)  # counted idle above
        with self._lock:
            self._threads -= 1

    def _next(self, claimed: bool) -> tuple | None:
        """The next job; a lazy pool counts a worker idle (unless already counted) until a job claims it."""
        if self.lazy and not claimed:
            with self._lock:
                self._idle += 1
        job = self._jobs.get()
        if job is None and self.lazy:  # close(): this worker was idle and ends
            with self._lock:
                self._idle = max(0, self._idle - 1)
        return job
