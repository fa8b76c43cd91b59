"""Environments in a process of their own (``producer.env_isolation = "process"``): the producer's side.

Consumes: a ``producer.environment`` reference, the deadline of each call (``producer.env_timeout_s``) and the
calls of one episode (``reset(prompt)``, then ``step(policy_text)`` per policy turn).
Produces: :class:`ProcessEnvironment`, an :class:`~producers.environment.Environment` whose instance lives in a
child process (:mod:`producers.env_worker`), one per episode, spoken to over its stdin and stdout in length-prefixed
msgpack frames (the prompt as its wire message; no pickle); answers are
:class:`~producers.environment.Observation` objects.
Guarantees: whatever the environment does to its own process, the producer goes on and the episode fails with the
reason (:mod:`producers.multiturn` dead-letters its group or plays it again):
- it exits, is killed or crashes (``os._exit``, a signal, a segfault): :class:`EnvironmentDied` naming the exit
  code or the signal, seen as soon as its pipe closes;
- a call past the deadline (a Python loop, or a C extension that never gives back the GIL, which a thread cannot
  stop): the process is killed (SIGKILL) and :class:`~producers.environment.EnvironmentTimeout` is raised;
- an answer over :data:`MAX_FRAME_BYTES`, or not a frame, is an :class:`EnvironmentDied` too (the process is
  killed): a hostile environment cannot make the producer allocate without bound;
- what the environment prints goes to the producer's stderr, never into the protocol;
- :meth:`ProcessEnvironment.close` (called at the end of every play) kills the process if it is still there.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import time
from typing import Any

import msgpack

from producers.environment import EnvironmentTimeout, Observation
from schemas import Prompt, encode

MAX_FRAME_BYTES = 16 << 20
"""The largest answer read from an environment's process (16 MiB): one observation's text and tags."""
_HEADER = struct.Struct(">I")


class EnvironmentDied(RuntimeError):
    """The environment's process ended (or broke its protocol) during a call; ``str()`` says how."""


class ProcessEnvironment:
    """One episode's environment, made and called in a child process (see the module docstring)."""

    def __init__(self, reference: str, deadline_s: float | None, name: str) -> None:
        self.reference, self.deadline_s, self.name = reference, deadline_s, name
        self.proc: subprocess.Popen | None = None

    def reset(self, prompt: Prompt) -> None:
        self._call({"op": "reset", "prompt": encode(prompt)}, "reset")

    def step(self, policy_text: str) -> Observation:
        value = self._call({"op": "step", "text": policy_text}, "step")
        if not isinstance(value, dict):
            raise EnvironmentDied(f"environment {self.name} step: its process answered {type(value).__name__}")
        return Observation(**value)

    def close(self) -> None:
        """Kill the process (an episode is over); idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()

    def _started(self) -> subprocess.Popen:
        if self.proc is None:
            path = os.pathsep.join(p for p in sys.path if p)  # the child imports what this process imports
            self.proc = subprocess.Popen([sys.executable, "-m", "producers.env_worker", self.reference],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                         env={**os.environ, "PYTHONPATH": path},
                                         start_new_session=True)  # a signal to the producer's group spares it
        return self.proc

    def _call(self, request: dict, what: str) -> Any:
        proc = self._started()
        deadline = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        try:
            assert proc.stdin is not None
            body = msgpack.packb(request, use_bin_type=True)
            proc.stdin.write(_HEADER.pack(len(body)) + body)
            proc.stdin.flush()
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(what) from None
        answer = msgpack.unpackb(self._frame(deadline, what), raw=False)
        if not isinstance(answer, dict) or "ok" not in answer:
            self.close()
            raise EnvironmentDied(f"environment {self.name} {what}: its process broke the protocol")
        if not answer["ok"]:
            raise RuntimeError(str(answer.get("error", "unknown error"))[:2000])
        return answer.get("value")

    def _frame(self, deadline: float | None, what: str) -> bytes:
        header = self._read(_HEADER.size, deadline, what)
        (size,) = _HEADER.unpack(header)
        if size > MAX_FRAME_BYTES:
            self.close()
            raise EnvironmentDied(f"environment {self.name} {what}: an answer of {size} bytes, over the "
                                  f"{MAX_FRAME_BYTES} byte limit; its process was killed")
        return self._read(size, deadline, what)

    def _read(self, size: int, deadline: float | None, what: str) -> bytes:
        proc = self._started()
        assert proc.stdout is not None
        fd, out = proc.stdout.fileno(), bytearray()
        while len(out) < size:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.close()
                raise EnvironmentTimeout(f"environment {self.name} {what} timed out after {self.deadline_s:g} s "
                                         f"(producer.env_timeout_s); its process was killed")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, min(size - len(out), 1 << 20))
            if not chunk:
                raise self._died(what)
            out += chunk
        return bytes(out)

    def _died(self, what: str) -> EnvironmentDied:
        proc = self._started()
        try:
            code = proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # it closed its pipes but lives on: end it
            self.close()
            code = proc.returncode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return EnvironmentDied(f"environment {self.name} {what}: its process died ({how})")
