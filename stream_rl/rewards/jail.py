"""The code sandbox's runner: one program, one private root, kernel limits (standard library only, so that it can
run as any user: the tests copy it and run it as an unprivileged one).

Consumes: a Python program's source, its stdin and :class:`SandboxLimits`.
Produces: :func:`run_sandboxed` -> :class:`RunResult` (exit status, bounded stdout and stderr, wall time);
:func:`preflight` (raises :class:`SandboxUnavailable` with one line when this host cannot sandbox) and
:func:`host_check` (the same as ``(ok, detail)``, for ``stream-rl doctor``).

How a run is built (util-linux and the kernel, nothing to install)::

    host: stdin, stdout, stderr = files the host opened (stdout/stderr unlinked: nothing to find by name)
          fd 3 = the program's source, fd 4 = the set-up marker pipe, fd 5 = the program's stderr
    [root: setpriv --reuid=65534 --regid=65534 --clear-groups]            # never run as real root
    unshare --user --map-root-user --mount --net --pid --fork --mount-proc --kill-child
      sh -c SETUP:  a size-limited tmpfs becomes the new root:  /usr /bin /lib* ... read-only binds (and the
                    interpreter's prefix when it lives elsewhere), /dev/{null,zero,full,random,urandom}, /proc of
                    the new PID namespace, an empty /tmp and /dev/shm, /box (the program, the working directory)
                    pivot_root into it and detach the host's tree: no host path is left to open
                    write "ok" to fd 4 and close it; stderr -> fd 5
      (sh stays PID 1 and waits; its exit status is 128 + signal when the program was killed)
      setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all --no-new-privs   # no capabilities left
        prlimit --cpu --as --nproc --fsize --core=0 -- python3 -I -B prog.py

Guarantees:
- The host never opens a path the program could have touched: outputs are read back through the host's own
  descriptors, at most ``output_kb`` of stdout and the last 4 KiB of stderr. A program that replaces or deletes
  files, plants FIFOs or symlinks, or makes directories cannot make the host block, read another file or fail.
- The program sees no host file outside the system directories (not /tmp, /run, /var/run, /dev/shm, /home, the
  project, other boxes), so no pathname socket, no group-only file there and no other run's box; abstract
  sockets and TCP are gone with the network namespace (only ``lo``, down). All it writes is bounded in total by
  ``disk_mb`` (one tmpfs for the root, /box and /tmp) and per file by ``output_kb``.
- CPU seconds (SIGXCPU), address space, processes and file size are kernel limits; the wall clock (``wall_s``,
  counted from the set-up marker, so set-up time is not the program's) kills the whole session, and as the
  program runs under PID 1 of its own namespace everything it started dies with it.
- Set-up success is reported out of band: only a set-up that did not write its marker raises
  :class:`SandboxUnavailable` (with the set-up's own error), never a program's exit status or stderr.
What it does not protect against (docs/reward-services.md, "Threat model"): kernel exploits (it shares the
host's kernel), side channels, and reads of world-readable files under the system directories.
"""

from __future__ import annotations

import fcntl
import os
import select
import shlex
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NOBODY = 65534
SETUP_TIMEOUT_S = 30.0
_MARKER = b"ok"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_STDERR_TAIL = 4096


class SandboxUnavailable(RuntimeError):
    """This machine cannot build the sandbox (no unprivileged user namespaces, no util-linux tools, ...)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits: CPU s, wall s, address space MiB, processes, per-file size = output KiB, all files MiB."""

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    processes: int = 32
    output_kb: int = 1024
    disk_mb: int = 16
    python: str = field(default_factory=lambda: _default_python())

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "output_kb", "disk_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")

    def prlimit_args(self) -> list[str]:
        """prlimit's options; CPU soft limit (SIGXCPU) ``cpu_s``, hard limit (SIGKILL) a second later."""
        return [f"--cpu={self.cpu_s}:{self.cpu_s + 1}", f"--as={self.memory_mb * 1024 * 1024}",
                f"--nproc={self.processes}", f"--fsize={self.output_kb * 1024}", "--core=0"]


def _default_python() -> str:
    """A system interpreter (a venv's python under /root is neither readable by the sandbox's user nor inside it)."""
    return shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin") or "/usr/bin/python3"


@dataclass(frozen=True)
class RunResult:
    """One sandboxed run: exit status (negative: killed by that signal), outputs (bounded), wall time."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    wall_killed: bool


def visible_dirs(python: str) -> list[str]:
    """The host directories bound read-only into the box: the system ones and the interpreter's prefix."""
    dirs = [d for d in _SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    prefix = str(Path(os.path.realpath(python)).parent.parent)  # /opt/py3/bin/python3 -> /opt/py3
    if prefix != "/" and not any(prefix == d or prefix.startswith(d + "/") for d in dirs):
        dirs.append(prefix)
    return dirs


def setup_script(limits: SandboxLimits) -> str:
    """The shell set-up run as the namespaces' root (see the module docstring); exits 97 naming what failed."""
    q = shlex.quote
    lines = ['fail() { echo "sandbox set-up failed: $*" >&2; exit 97; }',
             f"mount -t tmpfs -o size={limits.disk_mb * 1024}k,nr_inodes=8192,mode=755 srl-box /tmp || fail tmpfs",
             "cd /tmp || fail cd"]
    for d in visible_dirs(limits.python):
        lines.append(f"mkdir -p .{q(d)} && mount --bind {q(d)} .{q(d)} "
                     f"&& mount -o remount,bind,ro,nosuid,nodev .{q(d)} || fail bind {q(d)}")
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            lines.append(f"ln -s {q(os.readlink(d))} .{q(d)} || fail link {q(d)}")
    lines.append("mkdir -p dev/shm proc box .old && chmod 1777 dev/shm && mkdir -m 1777 tmp || fail dirs")
    for dev in _DEVICES:
        lines.append(f": > dev/{dev} && mount --bind /dev/{dev} dev/{dev} || fail device {dev}")
    lines += ["mount --rbind /proc proc || fail proc",
              "cat <&3 > box/prog.py && exec 3<&- || fail program",
              "pivot_root . .old && cd /box && umount -l /.old && rmdir /.old || fail pivot_root",
              "printf ok >&4 && exec 4>&- 2>&5 5>&- || fail marker",
              'setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all --no-new-privs "$@"; exit $?']
    return "\n".join(lines)


def sandbox_command(argv: list[str], limits: SandboxLimits) -> list[str]:
    """The full command line of the module docstring for running ``argv`` inside the box."""
    tools = {t: _tool(t) for t in ("setpriv", "unshare", "prlimit")}
    drop = ([tools["setpriv"], f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
            if os.geteuid() == 0 else [])
    namespaces = [tools["unshare"], "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork",
                  "--mount-proc", "--kill-child"]
    return [*drop, *namespaces, "/bin/sh", "-c", setup_script(limits), "sandbox", tools["prlimit"],
            *limits.prlimit_args(), "--", *argv]


def _tool(name: str) -> str:
    path = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise SandboxUnavailable(f"the code sandbox needs util-linux's {name!r}, not found on PATH")
    return path


def run_sandboxed(program: str, stdin: str, limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Run ``program`` (Python source) on ``stdin`` in a fresh private root under ``limits``."""
    command = sandbox_command([limits.python, "-I", "-B", "prog.py"], limits)
    with _HostFiles(program, stdin) as files:
        start = time.perf_counter()
        pid = _spawn(command, files)
        _await_marker(pid, files)  # SandboxUnavailable (the child reaped) when the set-up failed
        try:
            killed = not _wait(pid, limits.wall_s)
        finally:
            _kill_session(pid)
            status = os.waitpid(pid, 0)[1]
        wall = time.perf_counter() - start
        stdout = files.read_stdout(limits.output_kb * 1024)
        stderr = files.read_stderr_tail(_STDERR_TAIL)
    return RunResult(os.waitstatus_to_exitcode(status), stdout, stderr, wall, killed)


class _HostFiles:
    """The run's descriptors, opened by the host before the run and never re-opened by path."""

    def __init__(self, program: str, stdin: str):
        self.stdin = _filled(stdin.encode("utf-8", "surrogateescape"))
        self.program = _filled(program.encode("utf-8", "surrogateescape"))
        self.stdout = tempfile.TemporaryFile(prefix="srl-out-")
        self.stderr = tempfile.TemporaryFile(prefix="srl-err-")
        self.setup_log = tempfile.TemporaryFile(prefix="srl-setup-")
        self.marker_r, self.marker_w = os.pipe()

    def __enter__(self) -> _HostFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdin, self.program, self.stdout, self.stderr, self.setup_log):
            f.close()
        for fd in (self.marker_r, self.marker_w):
            _close(fd)

    def child_fds(self) -> list[tuple[int, int]]:
        """(host fd, child fd) pairs: 0-2 the standard streams (2 = set-up log), 3 program, 4 marker, 5 stderr."""
        return [(self.stdin.fileno(), 0), (self.stdout.fileno(), 1), (self.setup_log.fileno(), 2),
                (self.program.fileno(), 3), (self.marker_w, 4), (self.stderr.fileno(), 5)]

    def read_stdout(self, cap: int) -> str:
        return os.pread(self.stdout.fileno(), cap, 0).decode("utf-8", "replace")

    def read_stderr_tail(self, tail: int) -> str:
        size = os.fstat(self.stderr.fileno()).st_size
        return os.pread(self.stderr.fileno(), tail, max(0, size - tail)).decode("utf-8", "replace")

    def setup_error(self) -> str:
        text = os.pread(self.setup_log.fileno(), 2048, 0).decode("utf-8", "replace").strip()
        return " ".join(text.split())[-300:] or "no error message"


def _filled(data: bytes):  # an unlinked temporary file holding ``data``, positioned at its start
    f = tempfile.TemporaryFile(prefix="srl-in-")
    f.write(data)
    f.flush()
    f.seek(0)
    return f


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _spawn(command: list[str], files: _HostFiles) -> int:
    """posix_spawn (thread-safe) with the descriptors moved to fixed numbers; a new session = process group."""
    pairs = files.child_fds()
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd, _ in pairs]  # >= 10: no dup2 below overwrites one
    try:
        actions = [(os.POSIX_SPAWN_DUP2, src, target) for src, (_, target) in zip(moved, pairs)]
        env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"}
        try:
            pid = os.posix_spawn(command[0], command, env, file_actions=actions, setsid=True)
        except OSError as exc:
            raise SandboxUnavailable(f"the code sandbox could not start {command[0]}: {exc}") from None
    finally:
        for fd in moved:
            os.close(fd)
    _close(files.marker_w)
    files.marker_w = -1
    return pid


def _await_marker(pid: int, files: _HostFiles) -> None:
    """Wait for the set-up's marker; raise SandboxUnavailable with the set-up's own error when it never comes."""
    ready, _, _ = select.select([files.marker_r], [], [], SETUP_TIMEOUT_S)
    if ready and os.read(files.marker_r, 16) == _MARKER:
        return
    _kill_session(pid)
    os.waitpid(pid, 0)  # reaped here so that the set-up's error is complete; the caller does not reap again
    why = files.setup_error() if ready else f"it did not finish within {SETUP_TIMEOUT_S:g} s"
    raise SandboxUnavailable(f"the code sandbox could not be set up on this host: {why}")


def _wait(pid: int, timeout_s: float) -> bool:
    """True when ``pid`` exited within ``timeout_s`` (it is not reaped here)."""
    deadline = time.monotonic() + timeout_s
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            left = deadline - time.monotonic()
            if pidfd is not None:
                return bool(select.select([pidfd], [], [], max(0.0, left))[0])
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            if left <= 0:
                return False
            time.sleep(min(0.005, left))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone
        pass


_PROBE = "import os\nprint('sandbox ok', os.getcwd(), sorted(os.listdir('/tmp')))\n"
_PROBE_OK = "sandbox ok /box []\n"


def preflight(limits: SandboxLimits = SandboxLimits()) -> None:
    """Run a probe program in the real sandbox; raise :class:`SandboxUnavailable` (one line) unless it ran inside.

    Called where a role that runs programs starts (the scorer, ``stream-rl reward-server code_tests``, ``doctor``),
    so a host that cannot sandbox is refused at start-up instead of scoring every program 0.
    """
    if not os.path.exists(limits.python):
        raise SandboxUnavailable(f"the code sandbox's interpreter {limits.python} does not exist")
    run = run_sandboxed(_PROBE, "", limits)
    if run.returncode != 0 or run.stdout != _PROBE_OK:
        detail = " ".join((run.stderr.strip().splitlines() or [""])[-1:]) or f"stdout {run.stdout[:100]!r}"
        raise SandboxUnavailable(f"the code sandbox's probe program failed (exit {run.returncode}): {detail[:200]}")


def host_check(limits: SandboxLimits = SandboxLimits()) -> tuple[bool, str]:
    """``(True, how)`` when this host can sandbox programs, else ``(False, why)``: for ``stream-rl doctor``."""
    try:
        preflight(limits)
    except (SandboxUnavailable, OSError) as exc:
        return False, str(exc)
    who = f"uid {NOBODY} via setpriv" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    return True, (f"user, mount, network and PID namespaces as {who}; a private root on a {limits.disk_mb} MiB "
                  f"tmpfs; programs run with {limits.python}")
