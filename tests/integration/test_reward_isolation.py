"""User reward functions in worker processes (scorer.reward_isolation = "process", stream_rl.rewards.isolated), on
the scorer's own path (load_scoring -> score_rollouts) with real worker processes: a call that stalls in a regex is
killed at its deadline while the scorer's other threads keep running; a value msgpack cannot carry, a crash and
prints are each that rollout's failure with a reason (or nothing), and a worker dies with its scorer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.messages import rollout_for_scoring

from consumers.scorer.config import ScorerConfig
from consumers.scorer.scoring import Rejected, load_scoring, score_rollouts
from schemas import ScoredRollout

TESTS = str(Path(__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _workers_import_the_test_rewards(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p))


def _scoring(fn: str, timeout_s: float = 1.0):
    cfg = ScorerConfig(reward_fn=f"support.stalling_rewards:{fn}", reward_isolation="process",
                       reward_timeout_s=timeout_s, reward_concurrency=2, reward_max_retries=0)
    return load_scoring(cfg, "scorer-0")


class Ticker:
    """A thread of the scorer's process that wants to run every 10 ms: the longest gap it saw."""

    def __init__(self):
        self.gaps, self._stop = [0.0], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        last = time.perf_counter()
        while not self._stop.wait(0.01):
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return max(self.gaps)


def test_a_stalling_regex_is_killed_at_the_deadline_and_never_freezes_the_scorer():
    scoring = _scoring("backtracking", timeout_s=1.0)
    stall = rollout_for_scoring(0, 0, response_text="a" * 60 + "b")  # 2**60 steps: never ends on its own
    fine = [rollout_for_scoring(1, s, response_text="7") for s in range(3)]
    ticker = Ticker()
    start = time.perf_counter()
    outputs = score_rollouts([stall, *fine], scoring)
    elapsed, longest_gap = time.perf_counter() - start, ticker.stop()
    assert isinstance(outputs[0], Rejected) and "1 s" in outputs[0].reason, outputs[0]
    assert all(isinstance(o, ScoredRollout) and o.reward == 1.0 for o in outputs[1:])
    assert elapsed < 10 and longest_gap < 0.5, (elapsed, longest_gap)  # the GIL was never held by the stall
    again = score_rollouts([rollout_for_scoring(2, 0, response_text="7")], scoring)  # a fresh worker took over
    assert isinstance(again[0], ScoredRollout) and again[0].reward == 1.0


def test_unsendable_values_crashes_and_prints_fail_only_their_rollout():
    scoring = _scoring("chatty_huge_or_dying", timeout_s=20.0)
    huge = rollout_for_scoring(0, 0, metadata={"do": "huge"})
    dying = rollout_for_scoring(1, 0, metadata={"do": "die"})
    fine = rollout_for_scoring(2, 0)
    outputs = score_rollouts([huge, fine], scoring)
    assert isinstance(outputs[0], Rejected) and "integer beyond 64 bits" in outputs[0].reason, outputs[0]
    assert isinstance(outputs[1], ScoredRollout) and outputs[1].reward == 1.0  # its print did not corrupt a frame
    outputs = score_rollouts([dying], scoring)
    assert isinstance(outputs[0], Rejected) and "worker process died (exit code 3)" in outputs[0].reason
    assert isinstance(score_rollouts([fine], scoring)[0], ScoredRollout)


def test_a_bad_reference_is_refused_at_start_up_with_the_workers_error():
    cfg = ScorerConfig(reward_fn="support.stalling_rewards:no_such_fn", reward_isolation="process")
    with pytest.raises(Exception, match="no_such_fn"):
        load_scoring(cfg, "scorer-0")


def test_a_worker_stalled_in_a_call_dies_with_its_scorer():
    program = (
        "import sys, threading, time\n"
        "from stream_rl.rewards.isolated import IsolatedReward\n"
        "r = IsolatedReward('support.stalling_rewards:backtracking', timeout_s=600)\n"
        "threading.Thread(target=r, args=('p', 'a' * 60 + 'b', 'x', {}), daemon=True).start()\n"
        "time.sleep(1.0)\n"
        "print(' '.join(str(w.proc.pid) for w in list(r._idle.queue) if w is not None) or 'busy', flush=True)\n"
        "time.sleep(600)\n")
    scorer = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        assert scorer.stdout.readline().strip() == "busy"  # its only worker is inside the stalled call
        workers = _children(scorer.pid)
        assert len(workers) == 1
    finally:
        scorer.send_signal(signal.SIGKILL)
        scorer.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{workers[0]}").exists() and _state(workers[0]) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{workers[0]}").exists() or _state(workers[0]) == "Z", "the worker outlived its scorer"


def _children(pid: int) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(proc.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
