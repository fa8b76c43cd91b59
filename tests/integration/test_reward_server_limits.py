"""The reward server under load and bad clients (stream_rl.rewards.server, ``stream-rl reward-server``): real loopback
sockets against an in-process server and the real command. A burst of connections fits the listen backlog; the
connections handled at once are capped and the rest refused at once; a slow client loses its connection, not a
thread; a dropped client is one stderr line; huge, unsized and deeply nested bodies get 413, 411 and 400; ``--host
::1`` serves; ``/health`` answers 503 while scoring is wedged."""

from __future__ import annotations

import http.client
import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from support.hostile_http import connect, read_until_closed, reset, serving
from support.waiting import wait_for

from consumers.scorer.builtin_rewards import exact_match
from stream_rl.rewards.calls import CallPolicy, RewardCaller, RewardRequest
from stream_rl.rewards.http import HttpRewardClient, check_reachable
from stream_rl.rewards.server import LISTEN_BACKLOG, RewardServer, ServerLimits, per_rollout_scorer

POLICY = CallPolicy(timeout_s=5.0, concurrency=2, max_retries=0)
SHORT = ServerLimits(max_connections=4, connection_timeout_s=0.5)


def exact_server(limits: ServerLimits = ServerLimits(), host: str = "127.0.0.1") -> RewardServer:
    return RewardServer(per_rollout_scorer(exact_match, "exact_match"), name="exact_match", host=host,
                        limits=limits)


def scored(url: str) -> list[float | None]:
    requests = [RewardRequest("q", "42", "42", {}, 1), RewardRequest("q", "41", "42", {}, 1)]
    with RewardCaller(HttpRewardClient(url, timeout_s=POLICY.timeout_s), POLICY) as caller:
        return [o.output.reward if o.ok else None for o in caller.call(requests)]


def test_a_burst_of_connections_fits_the_listen_backlog():
    """64 connections at once while the server is busy (not accepting): the kernel queues them all (socketserver's
    backlog of 5 queued 6 and dropped the others' SYNs, costing each a 1 s retransmission)."""
    server = exact_server()  # listening, not yet accepting
    sockets = [socket.socket() for _ in range(64)]
    try:
        for sock in sockets:
            sock.setblocking(False)
            sock.connect_ex(server.server_address)
        established: set[socket.socket] = set()
        deadline = time.monotonic() + 1.0
        while len(established) < 64 and time.monotonic() < deadline:
            _, writable, _ = select.select([], [s for s in sockets if s not in established], [], 0.05)
            established |= {s for s in writable if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0}
        assert len(established) == 64 and LISTEN_BACKLOG >= 64
    finally:
        for sock in sockets:
            sock.close()
        server.server_close()


def test_connections_over_the_cap_are_refused_at_once_and_idle_ones_time_out():
    server = exact_server(SHORT)
    with serving(server) as url:
        idle = [connect(server.server_address) for _ in range(12)]
        deadline = time.monotonic() + 3.0
        try:
            answers = [read_until_closed(sock, max(0.05, deadline - time.monotonic())) for sock in idle]
        finally:
            for sock in idle:
                sock.close()
        refused = [data for data, closed in answers if data.startswith(b"HTTP/1.0 503 ")]
        timed_out = [data for data, closed in answers if closed and data == b""]
        assert (len(refused), len(timed_out)) == (8, 4)  # 4 handled (then dropped: silent), 8 refused at once
        assert b'"the server handles 4 connections at once (--max-connections); retry"' in refused[0]
        assert server.peak == 4 and server.refused == 8
        wait_for(lambda: server.active == 0, "the idle connections' threads to end", 3.0)
        assert scored(url) == [1.0, 0.0]  # the server goes on


def test_a_trickled_request_loses_its_connection_at_the_timeout():
    """Each byte comes well within the per-read timeout; the request as a whole does not: dropped at 0.5 s."""
    server = exact_server(SHORT)
    with serving(server):
        sock = connect(server.server_address)
        try:
            sock.sendall(b"POST / HTTP/1.0\r\nContent-Length: 1000\r\n\r\n")
            start, closed = time.monotonic(), False
            for _ in range(100):  # at most 2 s of trickle
                try:
                    sock.sendall(b" ")
                except OSError:
                    closed = True
                    break
                ready, _, _ = select.select([sock], [], [], 0.02)
                if ready and sock.recv(1024) == b"":
                    closed = True
                    break
            elapsed = time.monotonic() - start
        finally:
            sock.close()
    assert closed and elapsed < 1.5
    wait_for(lambda: server.dropped == 1, "the drop to be counted", 3.0)


def _raw_post(address: tuple, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*address[:2], timeout=5)
    try:
        conn.putrequest("POST", "/")
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders(body or None)
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        conn.close()


def test_huge_unsized_and_deeply_nested_bodies_get_413_411_and_400():
    server = exact_server(ServerLimits(max_body_bytes=1 << 20))
    with serving(server) as url:
        too_big = _raw_post(server.server_address, {"Content-Length": str(10**12)})  # the body is never sent
        unsized = _raw_post(server.server_address, {"Transfer-Encoding": "chunked"})
        nested = b"[" * 100_000
        deep = _raw_post(server.server_address, {"Content-Length": str(len(nested))}, nested)
        garbled = _raw_post(server.server_address, {"Content-Length": "12abc"})
        assert scored(url) == [1.0, 0.0]
    assert too_big == (413, {"error": "the body of 1000000000000 bytes is over the server's limit of 1048576 bytes"})
    assert unsized == (411, {"error": "a Content-Length is required (chunked bodies are not accepted)"})
    assert deep == (400, {"error": "bad request: JSON nested too deeply"})
    assert garbled == (400, {"error": "bad request: Content-Length '12abc' is not a number"})


def test_health_answers_503_while_scoring_is_wedged_and_ok_once_it_moves():
    release, entered = threading.Event(), threading.Event()

    def wedged(prompts, responses, answers, metadatas):
        entered.set()
        release.wait(10)
        return [1.0] * len(prompts)

    server = RewardServer(wedged, name="wedged", limits=ServerLimits(stuck_after_s=0.3))
    with serving(server) as url:
        check_reachable(url)  # healthy before
        caller = threading.Thread(target=scored, args=(url,), daemon=True)
        caller.start()
        assert entered.wait(5)
        status, report = wait_for(lambda: (h := _health(url))[0] == 503 and h, "/health to say stuck", 5.0)
        assert report["status"] == "stuck" and report["in_flight"] == 1
        assert report["reason"].startswith("a scoring call has been running for ")
        assert report["reason"].endswith(" s, over the 0.3 s limit (--stuck-after-s): scoring does not progress")
        with pytest.raises(ValueError, match=r"GET /health answered HTTP 503: .*stuck"):
            check_reachable(url)  # a scorer does not start against a wedged server
        release.set()
        caller.join(5)
        assert not caller.is_alive()
        status, report = _health(url)
    assert (status, report["status"], report["in_flight"], report["completed"]) == (200, "ok", 0, 1)


def _health(url: str) -> tuple[int, dict]:
    from support.http_get import get

    status, body = get(url + "health")
    return status, json.loads(body)


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "stream_rl.cli.main", "reward-server", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(60)
    if not (lines and lines[0]):
        proc.kill()
        raise AssertionError(f"no URL line; stderr: {proc.communicate(timeout=10)[1][-2000:]}")
    return proc, lines[0].strip()


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err[-2000:]


def test_clients_that_drop_their_connection_cost_one_line_each_not_a_traceback():
    proc, line = _start("exact_match")
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        url = line.rsplit(" ", 1)[1]
        address = ("127.0.0.1", int(url.rstrip("/").rsplit(":", 1)[1]))
        for _ in range(20):  # a request half sent, then the client crashes (RST)
            sock = connect(address)
            sock.sendall(b"POST / HTTP/1.0\r\nContent-Length: 1000\r\n\r\n{\"prompts\": [")
            reset(sock)
        reported = ("dropped its connection", "Exception occurred during processing of request")
        wait_for(lambda: sum(any(r in x for r in reported) for x in err) == 20, "20 dropped clients reported", 10.0)
        assert scored(url) == [1.0, 0.0]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert "Traceback (most recent call last):\n" not in err
    assert len(err) == 20 and all(x.endswith(" dropped its connection (ConnectionResetError)\n") for x in err), err[:40]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_the_command_serves_on_ipv6_loopback():
    proc, line = _start("exact_match", "--host", "::1")
    try:
        assert line.startswith("reward server serving exact_match at http://[::1]:")
        url = line.rsplit(" ", 1)[1]
        assert check_reachable(url)[0]
        assert scored(url) == [1.0, 0.0]
    finally:
        _stop(proc)
