"""Environments that attack the process they run in, for ``producer.env_isolation = "process"``
(tests/integration/test_env_isolation.py). Each writes its pid into ``$SRL_ENV_PIDS`` (a directory) at reset, so a
test can check that no process outlives its episode."""

from __future__ import annotations

import ctypes
import os
import re
import sys
from pathlib import Path

from producers.environment import Observation


class Guess:
    """A well-behaved environment: "higher or lower?" after the first turn, the end after the second."""

    def reset(self, prompt) -> None:
        self.turn = 0
        folder = os.environ.get("SRL_ENV_PIDS")
        if folder:
            (Path(folder) / str(os.getpid())).write_text(prompt.prompt_id)

    def step(self, policy_text: str) -> Observation:
        self.turn += 1
        print("an environment printing to its stdout", flush=True)  # must not reach the protocol
        return Observation("higher or lower?", done=self.turn > 1, tags={"pid": str(os.getpid())}, reward=0.5)


class Exits(Guess):
    def step(self, policy_text: str) -> Observation:
        os._exit(3)


class Segfaults(Guess):
    def step(self, policy_text: str) -> Observation:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
        raise AssertionError("unreachable")


class HoldsTheGil(Guess):
    """Catastrophic backtracking in ``re``: the match runs in C and never gives back the GIL (a thread deadline
    could not even fire in this process)."""

    def step(self, policy_text: str) -> Observation:
        re.match(r"(a+)+$", "a" * 64 + "b")
        raise AssertionError("unreachable")


class Floods(Guess):
    def step(self, policy_text: str) -> Observation:
        return Observation("x" * (20 << 20))  # 20 MiB: over the frame limit


class Raises(Guess):
    def step(self, policy_text: str) -> Observation:
        raise ValueError("the game server died")


class ClosesStdout(Guess):
    """Closes every descriptor it can see, the protocol's included, then answers."""

    def step(self, policy_text: str) -> Observation:
        for fd in range(3, 64):
            try:
                os.close(fd)
            except OSError:
                pass
        sys.stdout.flush()
        return Observation("still here?")


def _retry_addition():
    from stream_rl.demo.retry import RetryAddition

    return RetryAddition


class CrashesOnNonAddition(_retry_addition()):
    """The demo's retry environment, except that a prompt it cannot use kills its process instead of raising."""

    def reset(self, prompt) -> None:
        if "+" not in prompt.text:
            os._exit(7)
        super().reset(prompt)
