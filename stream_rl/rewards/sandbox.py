"""The ``code_tests`` reward: run the response's Python program against the prompt's test cases in a sandbox.

Consumes: a response holding a program (the last fenced ```` ```python ```` block, else the last fenced block, else
the whole response) and test cases in the reference answer (or, without one, ``metadata["tests"]``), as JSON::

    {"tests": [{"stdin": "1 2\\n", "stdout": "3\\n"}, ...]}      or just the list [{"stdin": ..., "stdout": ...}]

Produces: ``code_tests(prompt, response, answer, metadata) -> passed / total`` (the reward contract), and
:func:`run_tests` -> :class:`TestsResult` with one :class:`CaseResult` (passed, reason) per case.
A case passes when the program exits 0 and its stdout equals the expected stdout after trailing whitespace is
removed from every line and trailing empty lines are dropped.

The sandbox (util-linux and the kernel, nothing to install)::

    [root: setpriv --reuid=65534 --regid=65534 --clear-groups]       # never run as real root
    unshare --user --map-root-user --mount --net --pid --fork --mount-proc --kill-child
      sh -c: every mount re-mounted read-only; the throw-away box directory bind-mounted read-write; cd box
      setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all --no-new-privs   # no capabilities left
        prlimit --cpu --as --nproc --fsize --core=0 -- python3 -I -B prog.py < stdin > box/stdout 2> box/stderr

- no network: a new network namespace whose only interface (lo) is down;
- no writes outside the box (read-only mounts; without capabilities they cannot be re-mounted);
- CPU seconds (SIGXCPU), address space (MemoryError), processes (fork fails) and file size, which also bounds
  stdout and stderr (SIGXFSZ), are kernel limits; the wall clock is the caller's: past ``wall_s`` the whole
  process group is killed, and since the program is PID 1 of its own PID namespace, everything it started dies
  with it (even what left the process group);
- the box is a fresh temporary directory, deleted afterwards.

Guarantees: a hostile program (infinite loop, fork bomb, memory hog, network use, writes outside its box, output
flood, killing its parent) fails its case with the reason and never harms the caller; after the first case that
hits a limit, the remaining cases are not run (failed, ``"not run: an earlier case hit a limit"``). Test cases
that are missing or malformed raise ``ValueError`` naming what is wrong (the scorer dead-letters the rollout).
When the machine cannot create the namespaces, :class:`SandboxUnavailable` says so (never an unsandboxed run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
NOBODY = 65534
_SETUP = (
    'awk \'{print $5}\' /proc/self/mountinfo | sort -r | while read -r mp; do '
    'mount -o remount,bind,ro "$mp" 2>/dev/null; done; '
    'mount --bind "$BOX" "$BOX" && mount -o remount,bind,rw "$BOX" && cd "$BOX" || exit 97; '
    'setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all --no-new-privs "$@"; exit $?'
)
_SETUP_FAILED = 97


class SandboxUnavailable(RuntimeError):
    """This machine cannot build the sandbox (no unprivileged user namespaces, no util-linux tools)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits: CPU seconds, wall seconds, address space (MiB), processes, file size = output (KiB)."""

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    processes: int = 32
    output_kb: int = 1024
    python: str = field(default_factory=lambda: _default_python())

    def prlimit_args(self) -> list[str]:
        """prlimit's options; CPU soft limit (SIGXCPU) ``cpu_s``, hard limit (SIGKILL) a second later."""
        return [f"--cpu={self.cpu_s}:{self.cpu_s + 1}", f"--as={self.memory_mb * 1024 * 1024}", f"--nproc={self.processes}",
                f"--fsize={self.output_kb * 1024}", "--core=0"]


def _default_python() -> str:
    """A system interpreter the unprivileged sandbox user can read (a venv under /root may not be)."""
    return shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin") or "python3"


@dataclass(frozen=True)
class RunResult:
    """One sandboxed run: exit status (negative: killed by that signal), outputs (bounded), wall time."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    wall_killed: bool


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
    """The last ```python block, else the last fenced block, else the whole response (stripped)."""
    blocks = _FENCE.findall(response)
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


def sandbox_command(box: Path, argv: list[str], limits: SandboxLimits) -> list[str]:
    """The command line of the module docstring for running ``argv`` in ``box``."""
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if os.geteuid() == 0 else []
    namespaces = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork", "--mount-proc",
                  "--kill-child"]
    return [*drop, *namespaces, "sh", "-c", _SETUP, "sandbox", "prlimit", *limits.prlimit_args(), "--", *argv]


def run_sandboxed(program: str, stdin: str, limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run ``program`` (Python source) on ``stdin`` in a fresh box under ``limits``."""
    for tool in ("unshare", "setpriv", "prlimit"):
        if shutil.which(tool) is None:
            raise SandboxUnavailable(f"the code sandbox needs util-linux's {tool!r}, not found on PATH")
    with tempfile.TemporaryDirectory(prefix="stream-rl-box-") as tmp:
        box = Path(tmp)
        (box / "prog.py").write_text(program)
        (box / "stdin").write_text(stdin)
        if os.geteuid() == 0:
            for path in (box, box / "prog.py", box / "stdin"):
                os.chown(path, NOBODY, NOBODY)
        argv = [limits.python, "-I", "-B", "prog.py"]
        with open(box / "stdin", "rb") as fin, open(box / "stdout", "wb") as fout, open(box / "stderr", "wb") as ferr:
            result = _run(sandbox_command(box, argv, limits), box, fin, fout, ferr, limits.wall_s)
        cap = limits.output_kb * 1024
        stdout = (box / "stdout").read_bytes()[:cap].decode("utf-8", "replace")
        stderr = (box / "stderr").read_bytes()[-4096:].decode("utf-8", "replace")
    if result[0] == _SETUP_FAILED and "mount" in stderr:
        raise SandboxUnavailable(f"the code sandbox could not set up its mounts: {stderr.strip()[-200:]}")
    return RunResult(result[0], stdout, stderr, result[1], result[2])


def _run(command: list[str], box: Path, fin: Any, fout: Any, ferr: Any, wall_s: float) -> tuple[int, float, bool]:
    start = time.perf_counter()
    env = {"PATH": "/usr/bin:/bin", "BOX": str(box), "LANG": "C.UTF-8"}
    try:
        proc = subprocess.Popen(command, stdin=fin, stdout=fout, stderr=ferr, env=env, start_new_session=True)
    except OSError as exc:
        raise SandboxUnavailable(f"the code sandbox could not start: {exc}") from None
    killed = False
    try:
        proc.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
        killed = True
        _kill_group(proc.pid)
        proc.wait()
    return proc.returncode, time.perf_counter() - start, killed


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


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
