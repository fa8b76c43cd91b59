"""Reward functions in worker processes (``scorer.reward_isolation = "process"``): a stall cannot freeze the scorer.

Consumes: a reward function reference (``package.module:function``, the contract of
:mod:`stream_rl.rewards.contract`, per-rollout or :func:`stream_rl.rewards.calls.batched`, sync or async), a
deadline per call and a number of workers.
Produces: :class:`IsolatedReward`, a callable with the same contract (and the same ``batched`` mark) that
:class:`stream_rl.rewards.calls.RewardCaller` runs like any other: each call goes to an idle worker process
(``python -m stream_rl.rewards.isolated_worker REF``) as one msgpack frame and its value comes back as one.

Why: a reward function in the scorer's process holds its GIL while it runs pure-Python or regex code, so a call
that stalls (catastrophic backtracking on a degenerate response, an endless loop) freezes every other thread of
the scorer, heartbeats and commits included, and a deadline cannot interrupt it. In a worker it only blocks a pipe
read, which releases the GIL.

Protocol (pipes, never pickle)::

    parent -> worker   u32 length + msgpack {"args": [prompt, response, answer, metadata]}  (lists when batched)
    worker -> parent   u32 length + msgpack {"value": v} | {"error": type name, "message": str}
    worker start       one frame {"ready": true, "batched": bool} once the function imported

Guarantees:
- A call past ``timeout_s`` kills its worker (SIGKILL) and raises :class:`RewardWorkerTimeout`; the next call
  starts a fresh worker. A worker that dies (crash, ``os._exit``) raises :class:`RewardWorkerError` with its exit
  status, and is replaced. Neither ever stalls the caller beyond ``timeout_s`` (plus the start of a worker).
- An answer frame larger than ``max_answer_bytes`` kills the worker and fails the call. A value msgpack cannot
  carry (an integer beyond 64 bits, an object) is that call's error with the reason, in the worker.
- What the function prints goes to the scorer's stderr, never into the protocol.
- Importing the function fails at construction, with the worker's own error (a bad reference is refused at
  start-up, as in the scorer's process).
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgpack

START_TIMEOUT_S = 60.0
_LEN = struct.Struct(">I")


class RewardWorkerError(RuntimeError):
    """A reward worker process failed (died, answered nonsense, or its function raised)."""


class RewardWorkerTimeout(TimeoutError):
    """A call to a reward worker passed its deadline; the worker was killed."""


class _Worker:
    """One worker process and its two pipes."""

    def __init__(self, reference: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "stream_rl.rewards.isolated_worker", reference],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        hello = self.receive(START_TIMEOUT_S, 1 << 16)
        if not hello.get("ready"):
            self.kill()
            raise RewardWorkerError(f"reward worker for {reference!r} could not start: {hello.get('message')}")
        self.batched = bool(hello.get("batched"))

    def call(self, args: list[Any], timeout_s: float, max_bytes: int) -> Any:
        data = msgpack.packb({"args": args}, use_bin_type=True)
        try:
            self.proc.stdin.write(_LEN.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None
        answer = self.receive(timeout_s, max_bytes)
        if "error" in answer:
            raise RewardWorkerError(f"{answer['error']}: {answer.get('message', '')}")
        value = answer.get("value")
        if isinstance(value, list) and self.batched:  # a batch's per-rollout failures come back as {"error": ...}
            return [RewardWorkerError(v["error"]) if isinstance(v, dict) and set(v) == {"error"} else v
                    for v in value]
        return value

    def receive(self, timeout_s: float, max_bytes: int) -> dict:
        deadline = time.monotonic() + timeout_s
        head = self._read(_LEN.size, deadline)
        (size,) = _LEN.unpack(head)
        if size > max_bytes:
            self.kill()
            raise RewardWorkerError(f"reward worker answered {size} bytes, more than the cap of {max_bytes}")
        answer = msgpack.unpackb(self._read(size, deadline), raw=False, strict_map_key=False)
        if not isinstance(answer, dict):
            self.kill()
            raise RewardWorkerError(f"reward worker answered a {type(answer).__name__}, not a frame")
        return answer

    def _read(self, n: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise RewardWorkerTimeout("no answer before the deadline")
            chunk = os.read(fd, n - got)
            if not chunk:
                raise self._died()
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _died(self) -> RewardWorkerError:
        self.kill()
        code = self.proc.returncode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return RewardWorkerError(f"reward worker process died ({how})")

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class IsolatedReward:
    """``reference`` run in up to ``workers`` processes; each call bounded by ``timeout_s`` (module docstring)."""

    def __init__(self, reference: str, *, timeout_s: float, workers: int = 1, max_answer_bytes: int = 16 << 20):
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"IsolatedReward needs timeout_s > 0 and workers >= 1, got {timeout_s}, {workers}")
        self.reference, self.timeout_s, self.max_answer_bytes = reference, timeout_s, max_answer_bytes
        # Workers die with the thread that started them (PR_SET_PDEATHSIG is per thread): one long-lived thread
        # starts them all, never a pool thread that may end while its worker still serves others.
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-worker-spawn")
        first = self._new_worker()  # a bad reference fails here, at start-up
        self.batched = first.batched
        self.__qualname__ = reference
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._idle.put(first)
        for _ in range(workers - 1):
            self._idle.put(None)  # started on first use

    def _new_worker(self) -> _Worker:
        return self._spawner.submit(_Worker, self.reference).result()

    def __call__(self, *args: Any) -> Any:
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive:
                worker = self._new_worker()
            return worker.call([_plain(a) for a in args], self.timeout_s, self.max_answer_bytes)
        except RewardWorkerTimeout:
            raise RewardWorkerTimeout(f"reward {self.reference} did not return within {self.timeout_s:g} s; "
                                      "its worker process was killed") from None
        finally:
            self._idle.put(worker if worker is not None and worker.alive else None)

    def close(self) -> None:
        """Kill every idle worker and stop starting new ones (idempotent; busy ones end with their call)."""
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            if worker is not None:
                worker.kill()
        self._spawner.shutdown(wait=False)


def _plain(value: Any) -> Any:
    """Arguments as msgpack carries them: mappings as dicts, sequences (not strings) as lists."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value
