"""The gateway's HTTP server against clients that hold a connection: one that reads the answer in sips (each read
well within a socket timeout, the whole answer far beyond the deadline) and one that trickles its request. Each is
cut off at ``gateway.connection_timeout_s``, counted as dropped, and the gateway answers other clients meanwhile
and after; connections over ``gateway.max_connections`` are refused at once with an OpenAI error object. The server is the real one; the gateway behind it is a stub answering at once (no model, no broker)."""

from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

from support.hostile_http import connect, read_until_closed, serving
from support.http_get import get
from support.waiting import wait_for

from producers.gateway.server import GatewayServer

DEADLINE_S = 1.0
HEALTH = b'{"status": "ok", "version": 0, "group_size": 1, "model": "policy"}'
ANSWER = {"choices": [{"message": {"role": "assistant", "content": "x" * 1_000_000}}]}  # far over socket buffers


def _server(max_connections: int = 256) -> GatewayServer:
    gateway = SimpleNamespace(gcfg=SimpleNamespace(model_name="policy", group_size=1),
                              engine=SimpleNamespace(version=0), call=lambda kind, episode, body: ANSWER)
    server = GatewayServer(gateway, host="127.0.0.1", port=0, max_body_bytes=1 << 20,
                           connection_timeout_s=DEADLINE_S, max_connections=max_connections)
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it
    return server


def _post(sock: socket.socket, body: bytes, declared: int | None = None) -> None:
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nX-Episode-Id: e1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (len(body) if declared is None else declared) + body)


def test_a_client_reading_the_answer_in_sips_is_cut_off_at_the_deadline_and_others_are_served():
    server = _server()
    with serving(server) as url:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.settimeout(5.0)
        sock.connect(server.server_address)
        try:
            _post(sock, json.dumps({"model": "policy", "messages": []}).encode())
            start, read = time.monotonic(), b""
            while time.monotonic() - start < 2.5 * DEADLINE_S and server.dropped == 0:
                read += sock.recv(2048)  # 20 KiB/s: every read progresses, 1 MB would take 50 s
                time.sleep(0.1)
            cut_after = time.monotonic() - start
            assert server.dropped == 1, f"still writing after {cut_after:.1f} s"
            assert get(f"{url}health") == (200, HEALTH)  # the gateway serves on
            rest, closed = read_until_closed(sock, 5.0)
        finally:
            sock.close()
    assert read.startswith(b"HTTP/1.0 200 OK") and closed
    assert DEADLINE_S * 0.9 < cut_after < DEADLINE_S + 1.0
    assert len(read + rest) < 200_000  # cut off, far from the whole answer


def test_a_trickled_request_is_cut_off_at_the_deadline():
    server = _server()
    with serving(server) as url:
        sock = connect(server.server_address)
        try:
            _post(sock, b"{", declared=1000)
            start, closed = time.monotonic(), False
            while not closed and time.monotonic() - start < 2.5 * DEADLINE_S:
                try:
                    sock.sendall(b" ")  # a byte every 50 ms: within any per-read timeout
                except OSError:
                    break
                _, closed = read_until_closed(sock, 0.05)
            elapsed = time.monotonic() - start
        finally:
            sock.close()
        assert elapsed < DEADLINE_S + 1.0
        wait_for(lambda: server.dropped == 1, "the drop to be counted", 3.0)
        assert get(f"{url}health")[0] == 200


def test_connections_over_the_cap_are_refused_at_once_with_an_openai_error_and_the_gateway_serves_on():
    """An agent fleet (or an attacker) holding many idle connections: 3 are handled (each until its deadline), the
    other 9 get a 503 OpenAI error object at once, without a thread; once the idle ones are cut off, calls work."""
    server = _server(max_connections=3)
    with serving(server) as url:
        idle = [connect(server.server_address) for _ in range(12)]
        start = time.monotonic()
        try:
            answers = [read_until_closed(sock, max(0.05, start + 0.5 - time.monotonic())) for sock in idle]
        finally:
            for sock in idle:
                sock.close()
        refused = [data for data, closed in answers if data.startswith(b"HTTP/1.0 503 ")]
        assert len(refused) == 9 and server.refused == 9 and server.peak == 3
        body = json.loads(refused[0].split(b"\r\n\r\n", 1)[1])
        assert body == {"error": {"message": "the server handles 3 connections at once (gateway.max_connections); "
                                             "retry", "type": "server_error", "param": None,
                                  "code": "too_many_connections"}}
        wait_for(lambda: server.active == 0, "the idle connections to be cut off at the deadline", 3 * DEADLINE_S)
        assert get(f"{url}health") == (200, HEALTH)
