"""Attacks on the code sandbox's host side (issue 39, items 1-3), each run for real: a hostile program in the real
sandbox (stream_rl.rewards.jail), host sockets and files it must not reach, an unprivileged scorer with
supplementary groups, a host whose user namespaces are switched off, and the CLI that must refuse to start.

Every run is bounded: a host that blocked (a FIFO), read without end (/dev/zero) or raised (a deleted or replaced
output) fails the test instead of hanging it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from stream_rl.rewards import jail
from stream_rl.rewards.jail import SandboxLimits, SandboxUnavailable
from stream_rl.rewards.sandbox import run_tests

LIMITS = SandboxLimits(cpu_s=2, wall_s=5.0, memory_mb=256, processes=16, output_kb=64, disk_mb=4)
ROOT = os.geteuid() == 0
SECRET = "srl-host-secret-" + os.urandom(6).hex()


def bounded(program: str, expected: str = "ok\n", limits: SandboxLimits = LIMITS, bound_s: float = 30.0):
    """run_tests on one case in a thread: (passed, reason), or fail when the host side does not return."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(_capture(program, expected, limits)), daemon=True)
    thread.start()
    thread.join(bound_s)
    assert out, f"the host side did not return within {bound_s} s (blocked on what the program left)"
    if isinstance(out[0], BaseException):
        raise AssertionError(f"the host side raised {type(out[0]).__name__}: {out[0]}") from out[0]
    [case] = out[0].cases
    return case.passed, case.reason


def _capture(program: str, expected: str, limits: SandboxLimits) -> object:
    try:
        return run_tests(program, [{"stdin": "", "stdout": expected}], limits)
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        return exc


@pytest.fixture()
def open_dir():
    """A fresh directory under the system's temporary directory that every user may enter (pytest's own
    tmp_path sits under a 0700 directory: an unprivileged process could not reach it anyway)."""
    path = Path(tempfile.mkdtemp(prefix="srl-attack-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def secret_file(open_dir: Path) -> Path:
    """A root-only (0600) host file holding SECRET, in a directory anyone may enter."""
    path = open_dir / "secret.txt"
    path.write_text(SECRET + "\n")
    os.chmod(path, 0o600)
    return path


# -- 1. the host never follows what the program leaves behind ------------------------------------------------

TAMPER = {
    "fifo": "os.mkfifo(p)",
    "symlink to /dev/zero": "os.symlink('/dev/zero', p)",
    "symlink to a root-only file": "os.symlink(SECRET_PATH, p)",
    "symlink to /etc/shadow": "os.symlink('/etc/shadow', p)",
    "deleted": "pass",
    "a directory": "os.mkdir(p)",
}


@pytest.mark.parametrize("attack", sorted(TAMPER))
def test_tampering_with_the_output_files_changes_nothing_the_host_reads(attack, secret_file):
    program = (f"import os\nSECRET_PATH = {str(secret_file)!r}\nprint('wrong')\n"
               "for p in ('stdout', 'stderr', '/box/stdout', '/box/stderr'):\n"
               "    try:\n        os.remove(p)\n    except OSError:\n        pass\n"
               f"    try:\n        {TAMPER[attack]}\n    except OSError:\n        pass\n")
    passed, reason = bounded(program)
    assert not passed and reason == "wrong output: 'wrong\\n' expected 'ok\\n'"  # what it wrote, nothing else
    assert SECRET not in reason and "root:" not in reason


def test_a_program_cannot_read_host_files_outside_the_system_directories(secret_file):
    os.chmod(secret_file, 0o644)  # world-readable: only not being there protects it
    program = f"print(open({str(secret_file)!r}).read())\n"
    passed, reason = bounded(program)
    assert not passed and "FileNotFoundError" in reason and SECRET not in reason


def test_stdout_and_stderr_are_capped_and_read_from_the_hosts_descriptors():
    program = "import sys\nsys.stdout.write('x' * 50000)\nsys.stderr.write('e' * 50000)\nprint()\n"
    run = jail.run_sandboxed(program, "", LIMITS)
    assert run.returncode == 0 and len(run.stdout) == 50001 and len(run.stderr) == 4096


# -- 2. no host IPC, no group's files, a bounded and private box ---------------------------------------------

def _unix_listener(directory: Path) -> tuple[socket.socket, Path]:
    os.chmod(directory, 0o777)
    path = directory / "host.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o777)  # anyone may connect: only not being reachable protects it
    listener.listen(4)
    listener.settimeout(0.5)
    return listener, path


def _accepted(listener: socket.socket) -> bool:
    try:
        listener.accept()[0].close()
        return True
    except (TimeoutError, socket.timeout):
        return False


@pytest.mark.parametrize("where", ["tmp", "run"])
def test_host_unix_sockets_are_unreachable(where, tmp_path):
    if where == "run":
        if not os.access("/run", os.W_OK):
            pytest.skip("/run is not writable by this test's user: the /tmp case covers pathname sockets")
        directory = Path(tempfile.mkdtemp(prefix="srl-test-", dir="/run"))
    else:
        directory = tmp_path
    listener, path = _unix_listener(directory)
    try:
        program = (f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(path)!r})\n"
                   "s.sendall(b'hello host')\nprint('ok')\n")
        passed, reason = bounded(program)
        assert not passed and reason.startswith("exit code 1: FileNotFoundError"), reason
        assert not _accepted(listener)  # the host's listener never saw the program
    finally:
        listener.close()
        if where == "run":
            shutil.rmtree(directory, ignore_errors=True)


def test_disk_use_is_bounded_in_total_not_only_per_file():
    before = shutil.disk_usage(tempfile.gettempdir()).used
    program = ("import os\nfor i in range(100):\n"
               "    with open(f'/tmp/f{i}', 'wb') as f:\n        f.write(b'x' * 60 * 1024)\nprint('ok')\n")
    passed, reason = bounded(program)  # 100 files of 60 KiB (each under output_kb = 64) > disk_mb = 4 MiB
    assert not passed and "No space left on device" in reason, reason
    assert shutil.disk_usage(tempfile.gettempdir()).used - before < 2 * 1024 * 1024  # nothing landed on the host


def test_concurrent_boxes_cannot_see_each_other():
    writer = ("import os, time\nfor p in ('/box/mine.txt', '/tmp/mine.txt', '/dev/shm/mine.txt'):\n"
              "    open(p, 'w').write('private')\ntime.sleep(3)\nprint('ok')\n")
    reader = ("import os, glob\nfound = [p for p in ('/box/mine.txt', '/tmp/mine.txt', '/dev/shm/mine.txt') "
              "if os.path.exists(p)]\nfound += glob.glob('/tmp/*') + glob.glob('/box/*')\n"
              "print(sorted(found), len([p for p in os.listdir('/proc') if p.isdigit()]))\n")
    slow = SandboxLimits(cpu_s=2, wall_s=8.0, memory_mb=256, processes=16, output_kb=64, disk_mb=4)
    first: list[object] = []
    thread = threading.Thread(target=lambda: first.append(bounded(writer, limits=slow)), daemon=True)
    thread.start()
    time.sleep(1.5)  # the writer's box is set up and its files written (set-up takes ~0.15 s)
    passed, reason = bounded(reader, expected="x")
    thread.join(20)
    assert first == [(True, None)]
    assert reason == "wrong output: \"['/box/prog.py'] 2\\n\" expected 'x'"  # its own program; sh and itself


def _unprivileged_probe(tmp: Path, program: str, group: int) -> dict:
    """Run ``program`` in the sandbox from a scorer running as uid 65534 with supplementary group ``group``."""
    shutil.copy(Path(jail.__file__), tmp / "jail.py")
    (tmp / "probe.py").write_text(
        "import json, sys\nsys.path.insert(0, sys.argv[1])\nimport jail\n"
        "run = jail.run_sandboxed(sys.argv[2], '', jail.SandboxLimits(wall_s=5.0, disk_mb=4))\n"
        "print(json.dumps({'rc': run.returncode, 'out': run.stdout, 'err': run.stderr[-300:]}))\n")
    os.chmod(tmp, 0o755)
    for f in ("jail.py", "probe.py"):
        os.chmod(tmp / f, 0o644)
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", f"--groups={group}", jail._default_python(),
                           "-I", str(tmp / "probe.py"), str(tmp), program], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(not ROOT, reason="needs root to run a scorer as another user with a supplementary group")
def test_an_unprivileged_scorers_groups_reach_nothing_in_the_box(open_dir):
    group = 4242
    shared = open_dir / "group-only"
    shared.mkdir()
    os.chown(shared, 0, group)
    os.chmod(shared, 0o750)
    secret = shared / "secret.txt"
    secret.write_text(SECRET)
    os.chown(secret, 0, group)
    os.chmod(secret, 0o640)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(shared / "group.sock"))
    os.chown(shared / "group.sock", 0, group)
    os.chmod(shared / "group.sock", 0o660)
    listener.listen(1)
    listener.settimeout(0.5)
    control = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", f"--groups={group}", "cat", str(secret)],
                             capture_output=True, text=True, timeout=10)
    assert control.stdout == SECRET  # outside the box the group opens it: the test means something
    program = (f"import socket\nfor attempt in (lambda: open({str(secret)!r}).read(), "
               f"lambda: socket.socket(socket.AF_UNIX).connect({str(shared / 'group.sock')!r})):\n"
               "    try:\n        print(attempt())\n    except OSError as e:\n        print(type(e).__name__)\n")
    probe_dir = open_dir / "probe"
    probe_dir.mkdir()
    try:
        result = _unprivileged_probe(probe_dir, program, group)
    finally:
        reached = _accepted(listener)
        listener.close()
    assert result["rc"] == 0, result
    assert result["out"] == "FileNotFoundError\nFileNotFoundError\n" and not reached


# -- 3. set-up failures are told apart from programs' failures -----------------------------------------------

def test_a_program_that_mimics_a_setup_failure_is_only_a_failed_program():
    program = "import sys\nsys.stderr.write('mount: x\\n')\nsys.exit(97)\n"
    passed, reason = bounded(program)
    assert not passed and reason == "exit code 97: mount: x"


def test_a_host_without_nested_user_namespaces_is_refused_not_scored_zero(tmp_path):
    """The real failure: the scorer runs inside a user namespace that allows no more of them (a container)."""
    shutil.copy(Path(jail.__file__), tmp_path / "jail.py")
    (tmp_path / "probe.py").write_text(
        "import sys\nsys.path.insert(0, sys.argv[1])\nimport jail\n"
        "try:\n    jail.run_sandboxed('print(1)', '')\nexcept jail.SandboxUnavailable as e:\n"
        "    print('SandboxUnavailable:', e)\nelse:\n    print('ran')\n")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                           'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -I "$1" "$2"',
                           jail._default_python(), str(tmp_path / "probe.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    if "Operation not permitted" in done.stderr or "unshare failed" in done.stderr:
        pytest.skip(f"this host cannot create the test's outer user namespace: {done.stderr.strip()[:200]}")
    assert done.stdout.startswith("SandboxUnavailable: the code sandbox could not be set up on this host: "), \
        done.stdout + done.stderr


@pytest.fixture()
def failing_unshare(open_dir, monkeypatch):
    """An ``unshare`` first on PATH that fails as util-linux's does where user namespaces are switched off."""
    bin_dir = open_dir / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "unshare"
    tool.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def test_unshare_failing_raises_sandbox_unavailable_with_its_error(failing_unshare):
    with pytest.raises(SandboxUnavailable, match="unshare failed: Operation not permitted"):
        run_tests("print('ok')", [{"stdin": "", "stdout": "ok"}], LIMITS)
    ok, detail = jail.host_check(LIMITS)
    assert not ok and "unshare failed" in detail


def test_reward_server_refuses_to_start_with_one_line_when_the_host_cannot_sandbox(failing_unshare):
    done = subprocess.run([sys.executable, "-m", "stream_rl.cli.main", "reward-server", "code_tests", "--port", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the code sandbox could not be set up on this host: ")
    assert "unshare failed" in lines[0] and "serving" not in done.stdout


def test_the_scorer_refuses_to_start_when_its_rewards_need_a_sandbox(failing_unshare):
    from consumers.scorer.config import ScorerConfig
    from consumers.scorer.scoring import load_scoring

    cfg = ScorerConfig(reward_fn="stream_rl.rewards.sandbox:code_tests")
    with pytest.raises(SandboxUnavailable, match="unshare failed"):
        load_scoring(cfg, "scorer-0")


def test_doctor_reports_whether_this_host_can_sandbox():
    from stream_rl.operator_tools.doctor import check_sandbox

    row = check_sandbox()
    assert row.name == "code sandbox" and row.status == "pass" and "namespaces" in row.detail, row
