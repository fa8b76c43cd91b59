"""Issue 35.4: how a role ends. SIGTERM gives 143 (128 + 15, docs/operations.md's table) however often it comes;
a scorer that lost its broker ends on one ``BrokerUnreachable`` line, with no teardown traceback after it; a client
that fails during an outage names the outage's length, not the few seconds that client tried."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.waiting import wait_for

from stream_rl import broker as broker_mod
from stream_rl.config.sections import BrokerConfig

SCORE = [sys.executable, "-m", "stream_rl.cli.main", "score", "--set", "run.demo_dir=null",
         "--set", "scorer.reward_fn=consumers.scorer.builtin_rewards:exact_match", "--set", "scorer.poll_timeout_s=0.2"]


def _start_scorer(bootstrap: str, run: str, run_dir: Path, *extra: str):
    """`stream-rl score` as a process, and the list its stderr lines are appended to (read on a thread)."""
    proc = subprocess.Popen([*SCORE, "--bootstrap", bootstrap, "--run", run, "--set", f"run_dir={run_dir}", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    return proc, lines


@pytest.fixture
def own_broker(tmp_path):
    """A broker of this test's own (stopped by the test, and again at the end: a no-op when already down)."""
    cfg = BrokerConfig(state_dir=tmp_path / "own-broker", storage="memory")
    state = broker_mod.up(cfg)
    yield cfg, state.bootstrap
    broker_mod.down(cfg)


@pytest.mark.broker
def test_sigterm_ends_a_role_with_143_also_when_it_comes_again_during_the_exit(broker, run_name, tmp_path):
    proc, lines = _start_scorer(broker.bootstrap, run_name, tmp_path / "run")
    try:
        wait_for(lambda: any("subscribed to" in line for line in lines), "the scorer's loop", 60)
        while proc.poll() is None:  # the first one asks for the stop; the others land in the loop or the teardown
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.02)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, "".join(lines[-20:])


@pytest.mark.broker
def test_a_scorer_that_lost_its_broker_ends_on_one_line_without_a_teardown_traceback(own_broker, run_name,
                                                                                       tmp_path):
    cfg, bootstrap = own_broker
    proc, lines = _start_scorer(bootstrap, run_name, tmp_path / "run", "--set", "kafka.broker_timeout_s=3",
                                "--set", "kafka.connect_timeout_s=2")
    try:
        wait_for(lambda: any("subscribed to" in line for line in lines), "the scorer's loop", 60)
        time.sleep(1.0)  # a heartbeat or two on the broker
        broker_mod.down(cfg)
        proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)  # the reader thread has the last lines
    err = "".join(lines)
    assert proc.returncode == 1, err[-3000:]
    assert lines[-1].startswith("BrokerUnreachable (broker ") and "unreachable: no answer for" in lines[-1], err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]


@pytest.mark.broker
def test_a_client_that_fails_during_an_outage_names_how_long_it_lasted(own_broker, make_config):
    from stream_rl.cli.errors import explain
    from stream_rl.transport.client import Transport

    cfg, bootstrap = own_broker
    transport = Transport(make_config(**{"kafka.bootstrap_servers": bootstrap, "kafka.connect_timeout_s": 1,
                                         "kafka.broker_timeout_s": 2}), "t")
    transport.ensure_topics()
    sink = transport.sink()
    sink.send_raw(transport.names.dlq, b"x")
    sink.flush()  # this process heard from the broker now
    sink.close()
    broker_mod.down(cfg)
    down_at = time.monotonic()
    time.sleep(4.0)
    with pytest.raises(Exception) as failed:
        with transport.admin() as admin:  # a new client, built during the outage: it tries for 1 s
            admin.list_topics()
    outage = time.monotonic() - down_at
    code, line = explain(failed.value)
    assert code == 1 and line.startswith(f"no Kafka broker at {bootstrap}: no answer for "), line
    said = int(line.split("no answer for ")[1].split(" s")[0])
    assert outage - 1 <= said <= outage + 1 and said >= 5, line  # not the 1 s the failing client tried

