"""The code_tests reward's sandbox (stream_rl.rewards.sandbox), run for real (user, mount, network and PID
namespaces, prlimit): correct programs pass, and hostile programs are contained and scored with their reason, the
test process unharmed and every test bounded in time."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from stream_rl.rewards.sandbox import (
    SandboxLimits,
    code_tests,
    extract_program,
    parse_tests,
    run_tests,
    same_output,
)

LIMITS = SandboxLimits(cpu_s=1, wall_s=3.0, memory_mb=256, processes=16, output_kb=64)
ADD = [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "20 22\n", "stdout": "42"}]


def one_case(program: str, stdin: str = "", stdout: str = "ok\n") -> tuple[bool, str | None, float]:
    start = time.perf_counter()
    [case] = run_tests(program, [{"stdin": stdin, "stdout": stdout}], LIMITS).cases
    elapsed = time.perf_counter() - start
    assert elapsed < LIMITS.wall_s + 3  # every hostile run is bounded
    return case.passed, case.reason, elapsed


def test_correct_and_wrong_programs_score_the_fraction_passed():
    right = "a, b = map(int, input().split())\nprint(a + b)\n"
    off_by_one = "a, b = map(int, input().split())\nprint(a + b + (a == 20))\n"
    assert run_tests(right, ADD, LIMITS).reward == 1.0
    result = run_tests(off_by_one, ADD, LIMITS)
    assert result.reward == 0.5
    assert result.cases[1].reason == "wrong output: '43\\n' expected '42'"


def test_reward_function_reads_fenced_program_and_json_answer():
    response = "Here:\n```python\nprint(int(input()) * 2)\n```\n"
    answer = json.dumps({"tests": [{"stdin": "4", "stdout": "8"}, {"stdin": "5", "stdout": "11"}]})
    assert code_tests("double it", response, answer, {}) == 0.5
    assert code_tests("double it", response, None, {"tests": answer}) == 0.5


def test_infinite_loop_hits_the_cpu_limit():
    passed, reason, _ = one_case("while True:\n    pass\n")
    assert not passed and reason == "CPU time limit: 1 s"


def test_sleeping_program_is_killed_by_the_wall_clock():
    passed, reason, elapsed = one_case("import time\ntime.sleep(60)\n")
    assert not passed and reason == "wall-clock limit: killed after 3 s"
    assert 2.9 < elapsed < 5


def test_fork_bomb_hits_the_process_limit():
    passed, reason, _ = one_case("import os\nwhile True:\n    os.fork()\n")
    assert not passed and reason == "process limit: more than 16 processes"


def test_memory_hog_hits_the_memory_limit():
    passed, reason, _ = one_case("x = bytearray(1 << 30)\nprint('ok')\n")
    assert not passed and reason == "memory limit: 256 MiB address space"


def test_output_flood_hits_the_output_limit():
    passed, reason, _ = one_case("while True:\n    print('y' * 1000)\n")
    assert not passed and reason == "output limit: more than 64 KiB written"


def test_network_connection_is_impossible():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted: list[object] = []
    listener.settimeout(4)
    thread = threading.Thread(target=lambda: accepted.append(_accept(listener)), daemon=True)
    thread.start()
    program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('ok')\n"
    passed, reason, _ = one_case(program)
    thread.join(6)
    listener.close()
    assert not passed and reason.startswith("exit code 1: ")
    assert "Network is unreachable" in reason or "Connection refused" in reason
    assert accepted == [None]  # the host's server never saw a connection


def _accept(listener: socket.socket) -> object:
    try:
        return listener.accept()
    except TimeoutError:
        return None


def test_writes_outside_the_box_fail():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="h7-open-") as open_dir:
        os.chmod(open_dir, 0o777)  # writable by anyone, the sandbox's user included: the box does not even see it
        target = Path(open_dir) / "escaped.txt"
        passed, reason, _ = one_case(f"open({str(target)!r}, 'w').write('x')\nprint('ok')\n")
        assert not passed and reason == f"exit code 1: FileNotFoundError: [Errno 2] No such file or directory: {str(target)!r}"
        assert not target.exists()
    passed, reason, _ = one_case("open('/usr/escaped.txt', 'w').write('x')\nprint('ok')\n")  # a visible system dir
    assert not passed and reason == "exit code 1: OSError: [Errno 30] Read-only file system: '/usr/escaped.txt'"
    assert not os.path.exists("/usr/escaped.txt")


def test_writes_inside_the_box_work_and_the_box_is_thrown_away():
    import tempfile

    before = set(os.listdir(tempfile.gettempdir()))
    program = ("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())\nimport os\n"
               "print(os.getcwd())\nopen('/tmp/t', 'w').write('t')\n")
    [case] = run_tests(program, [{"stdin": "", "stdout": "ok"}], LIMITS).cases
    assert case.reason == "wrong output: 'ok\\n/box\\n' expected 'ok'"  # its box is /box of its own root
    assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if "srl" in n or "box" in n}


def test_program_killing_its_parent_and_everyone_harms_nobody():
    program = ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
               "try:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    print('nobody else')\n"
               "print('ok')\n")
    passed, reason, _ = one_case(program, stdout="nobody else\nok\n")
    assert passed and reason is None  # its parent survived (it went on printing) and it saw no other process
    assert os.getppid() > 1  # this test process and its parent are alive


def test_a_limit_stops_the_remaining_cases():
    result = run_tests("import time\ntime.sleep(60)\n", [{"stdin": "", "stdout": "1"}] * 3,
                       SandboxLimits(wall_s=1.0))
    assert [c.reason for c in result.cases] == ["wall-clock limit: killed after 1 s",
                                                "not run: an earlier case hit a limit",
                                                "not run: an earlier case hit a limit"]
    assert result.reward == 0.0


@pytest.mark.parametrize("answer, message", [
    (None, "found none"),
    ("not json", "is not JSON test cases"),
    ("[]", "non-empty list"),
    ('[{"stdin": "1"}]', "test case 0 of the answer must be"),
])
def test_bad_test_cases_are_refused_with_the_reason(answer, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(answer, {})


def test_program_extraction_and_output_comparison():
    assert extract_program("a\n```py\nprint(1)\n```\nb\n```python\nprint(2)\n```") == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("  print(4)  ") == "print(4)"
    assert same_output("3  \n\n\n", "3") and not same_output("3\n4", "3")


def test_only_system_directories_and_the_interpreters_prefix_are_bound():
    from stream_rl.rewards.jail import visible_dirs

    system = visible_dirs("/usr/bin/python3")
    assert "/usr" in system and "/" not in system and not any(d.startswith(("/tmp", "/home", "/root")) for d in system)
    assert visible_dirs("/opt/py311/bin/python3") == [*system, "/opt/py311"]
    assert visible_dirs("/python3") == system  # a prefix of "/" would bind the whole host: never
