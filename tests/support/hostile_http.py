"""Loopback HTTP servers that answer as a test scripts them (redirect elsewhere, close mid-answer, trickle, flood),
and raw-socket clients that misbehave, for the reward transport's and the reward server's tests.

Every server runs in a daemon thread on 127.0.0.1 (or ::1) on an ephemeral port, records each request it read, and
is stopped by :func:`serving` (its ``stop`` event set first, so that a trickling handler returns).
"""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Script = Callable[[BaseHTTPRequestHandler, int], None]
"""``script(handler, n)``: answer the n-th request (1-based) through ``handler`` (see :func:`reply`)."""


class Scripted(ThreadingHTTPServer):
    """A server whose every answer is written by ``script``; ``seen`` holds what each request sent."""

    daemon_threads = True

    def __init__(self, script: Script, host: str = "127.0.0.1") -> None:
        self.script, self.seen, self.stop = script, [], threading.Event()
        self._lock = threading.Lock()
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, 0), _ScriptedHandler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        host = self.server_address[0]
        return f"http://[{host}]:{self.port}/" if ":" in host else f"http://{host}:{self.port}/"

    def record(self, handler: BaseHTTPRequestHandler, body: bytes) -> int:
        with self._lock:
            self.seen.append({"method": handler.command, "path": handler.path, "headers": dict(handler.headers),
                              "body": body})
            return len(self.seen)

    def handle_error(self, request, client_address) -> None:  # a client that went away is part of the test
        return


class _ScriptedHandler(BaseHTTPRequestHandler):
    server: Scripted

    def log_message(self, *args) -> None:
        return

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        n = self.server.record(self, self.rfile.read(length) if length else b"")
        self.server.script(self, n)


def reply(handler: BaseHTTPRequestHandler, status: int, body: bytes | dict = b"",
          headers: Iterable[tuple[str, str]] = (), content_type: str = "application/json") -> None:
    """A complete answer (a dict body is sent as JSON)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    for name, value in headers:
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(data)


def rewards(values: list) -> Script:
    """A script answering ``{"rewards": values}`` to every request."""
    return lambda handler, n: reply(handler, 200, {"rewards": values})


@contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[str]:
    """Serve in a daemon thread; yield the URL; stop (``stop`` event first) and close."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
    finally:
        getattr(server, "stop", threading.Event()).set()
        server.shutdown()
        server.server_close()


def connect(address: tuple, *, timeout_s: float = 5.0) -> socket.socket:
    """A connected TCP socket to ``(host, port)`` (IPv4 or IPv6)."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(address)
    return sock


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP RST (SO_LINGER 0), as a client that crashed or was killed does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """What ``sock`` receives until the peer closes it or ``timeout_s`` passes: ``(data, closed)``."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False
