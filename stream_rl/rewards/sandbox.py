"""The ``code_tests`` reward: run the response's Python program against the prompt's test cases in a sandbox.

Consumes: a response holding a program (the last fenced ```` ```python ```` block, else the last fenced block, else
the whole response) and test cases in the reference answer (or, without one, ``metadata["tests"]``), as JSON::

    {"tests": [{"stdin": "1 2\\n", "stdout": "3\\n"}, ...]}      or just the list [{"stdin": ..., "stdout": ...}]

Produces: ``code_tests(prompt, response, answer, metadata) -> passed / total`` (the reward contract, with a
``preflight`` attribute the scorer and ``stream-rl reward-server`` call at start-up), and :func:`run_tests` ->
:class:`TestsResult` with one :class:`CaseResult` (passed, reason) per case.
A case passes when the program exits 0 and its stdout equals the expected stdout after trailing whitespace is
removed from every line and trailing empty lines are dropped.

The sandbox itself (a private root in new user, mount, network and PID namespaces, kernel limits, outputs read
back only through the host's own descriptors) is :mod:`stream_rl.rewards.jail`; its guarantees are listed there
and its threat model is in docs/reward-services.md.

Guarantees: a hostile program (infinite loop, fork bomb, memory hog, network or host-socket use, writes outside its
box, output or disk flood, tampering with its outputs, killing its parent) fails its case with the reason and never
harms the caller; after the first case that hits a limit, the remaining cases are not run (failed, ``"not run: an
earlier case hit a limit"``). Test cases that are missing or malformed raise ``ValueError`` naming what is wrong
(the scorer dead-letters the rollout). When the host cannot build the sandbox, :class:`SandboxUnavailable` says so
(never an unsandboxed run, and never because of what a program printed or how it exited).
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from stream_rl.rewards.jail import RunResult, SandboxLimits, SandboxUnavailable, host_check, preflight, run_sandboxed

__all__ = ["CaseResult", "RunResult", "SandboxLimits", "SandboxUnavailable", "TestsResult", "case_reason",
           "code_tests", "extract_program", "host_check", "parse_tests", "preflight", "run_sandboxed", "run_tests",
           "same_output"]

_HEAD = re.compile(r"([A-Za-z0-9_+-]{0,32})[ \t]{0,64}\n")  # a fenced block's opening line, bounded


@dataclass(frozen=True)
class CaseResult:
    passed: bool
    reason: str | None  # None when passed
    limit_hit: bool = False


@dataclass(frozen=True)
class TestsResult:
    cases: list[CaseResult]

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.cases)

    @property
    def reward(self) -> float:
        """``passed / total``."""
        return self.passed / len(self.cases)


def extract_program(response: str) -> str:
    """The last ```python block, else the last fenced block, else the whole response (stripped).

    Fences pair up in order (the 1st ``` opens, the 2nd closes, ...); a block's opening line is ``` plus an
    optional language tag and spaces. Linear time: one split, no backtracking.
    """
    parts = response.split("```")
    blocks: list[tuple[str, str]] = []
    for inside in parts[1:-1:2]:  # closed blocks only
        head = _HEAD.match(inside)
        if head:
            blocks.append((head.group(1), inside[head.end():]))
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else response.strip()


def parse_tests(answer: str | None, metadata: Mapping[str, str]) -> list[dict[str, str]]:
    """The test cases from the answer (or ``metadata["tests"]``); ValueError naming what is wrong."""
    source, text = ("answer", answer) if answer else ("metadata['tests']", metadata.get("tests"))
    if not text:
        raise ValueError("code_tests needs test cases in the reference answer or metadata['tests'], found none")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"code_tests: the {source} is not JSON test cases: {exc}") from None
    cases = data.get("tests") if isinstance(data, dict) else data
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"code_tests: the {source} must be a non-empty list of test cases (or {{'tests': [...]}})")
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or not isinstance(case.get("stdout"), str) \
                or not isinstance(case.get("stdin", ""), str):
            raise ValueError(f"code_tests: test case {i} of the {source} must be {{'stdin': str, 'stdout': str}}")
    return [{"stdin": c.get("stdin", ""), "stdout": c["stdout"]} for c in cases]


def same_output(actual: str, expected: str) -> bool:
    """Equal after trailing whitespace is removed from each line and trailing empty lines are dropped."""
    def norm(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.splitlines()]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(actual) == norm(expected)


def case_reason(run: RunResult, expected: str, limits: SandboxLimits) -> CaseResult:
    """Whether a run passed its case, and if not why (a hit limit is flagged)."""
    code = -(run.returncode - 128) if 128 < run.returncode < 128 + 65 else run.returncode  # sh: 128 + signal
    if run.wall_killed:
        return CaseResult(False, f"wall-clock limit: killed after {limits.wall_s:g} s", True)
    if code == -signal.SIGXCPU:
        return CaseResult(False, f"CPU time limit: {limits.cpu_s} s", True)
    if code == -signal.SIGXFSZ or "File too large" in run.stderr:  # Python ignores SIGXFSZ: write() fails
        return CaseResult(False, f"output limit: more than {limits.output_kb} KiB written", True)
    if "BlockingIOError" in run.stderr and "fork" in run.stderr:
        return CaseResult(False, f"process limit: more than {limits.processes} processes", True)
    if "MemoryError" in run.stderr:
        return CaseResult(False, f"memory limit: {limits.memory_mb} MiB address space", True)
    if code < 0:
        return CaseResult(False, f"killed by signal {signal.Signals(-code).name}", True)
    if code != 0:
        last = run.stderr.strip().splitlines()[-1:] or [""]
        return CaseResult(False, f"exit code {code}: {last[0][:200]}")
    if not same_output(run.stdout, expected):
        return CaseResult(False, f"wrong output: {run.stdout[:80]!r} expected {expected[:80]!r}")
    return CaseResult(True, None)


def run_tests(program: str, tests: list[dict[str, str]], limits: SandboxLimits = SandboxLimits()) -> TestsResult:
    """Every case (see the module docstring), stopping after the first that hits a limit."""
    cases: list[CaseResult] = []
    for case in tests:
        if any(c.limit_hit for c in cases):
            cases.append(CaseResult(False, "not run: an earlier case hit a limit"))
        else:
            cases.append(case_reason(run_sandboxed(program, case["stdin"], limits), case["stdout"], limits))
    return TestsResult(cases)


def code_tests(prompt: str, response: str, answer: str | None, metadata: dict[str, str]) -> float:
    """Reward contract: the fraction of the prompt's test cases the response's program passes, in the sandbox."""
    return run_tests(extract_program(response), parse_tests(answer, metadata)).reward


code_tests.preflight = preflight  # type: ignore[attr-defined]  # start-up check: can this host sandbox?
