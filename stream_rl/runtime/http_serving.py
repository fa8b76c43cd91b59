"""Deadlines on sockets, and the bounded request handler that the reward server
(:mod:`stream_rl.rewards.server`) and the gateway (:mod:`producers.gateway.server`) both serve with (standard
library only).

Consumes: a socket and a deadline (:data:`WATCHDOG`); for :class:`BoundedHandler`, a server with a
``connection_timeout_s`` attribute (seconds) and, for :class:`BoundedServer`, a name for its log lines.
Produces: :data:`WATCHDOG`, one daemon thread per process that shuts a socket down at its deadline (the reward
client's exchanges use it too: :mod:`stream_rl.rewards.http`); :class:`BoundedHandler`, whose :meth:`send_json`
writes one JSON answer; :class:`BoundedServer`, which counts and logs dropped clients.

One connection::

    accepted ─► request line, headers, body ─► request_read() ─► the work ─► send_json(): head and body
                └─ connection_timeout_s ──┘                    (unbounded)       └─ connection_timeout_s ┘

Guarantees: a client has ``connection_timeout_s`` in total to send its request and again to read the answer; at a
deadline the watchdog shuts the socket down, which wakes the blocked read or write: a client that trickles its
request, or reads the answer a byte at a time, loses its connection, not a thread for ever (a socket timeout per
read and write alone would not bound it: each byte resets it). The time the work takes is not bounded here. A
client that drops its connection, or is dropped, costs one warning line and a count (``dropped``), never a
traceback.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)


class _Watchdog:
    """One daemon thread for the process that shuts a socket down at its deadline, waking whatever blocks on it
    (a read of a trickled answer or request, a write to a client that does not read)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, list]] = []  # (deadline, seq, [socket or None, fired event])
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket, deadline: float, fired: threading.Event) -> list:
        """Shut ``sock`` down at ``deadline`` (and set ``fired``) unless :meth:`cancel` is called first."""
        entry = [sock, fired]
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), entry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="socket-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
        return entry

    def cancel(self, entry: list) -> None:
        with self._cond:
            entry[0] = None  # nothing to shut down; the entry leaves the heap at its deadline

    @contextmanager
    def guard(self, sock: socket.socket, deadline: float, fired: threading.Event) -> Iterator[None]:
        entry = self.watch(sock, deadline, fired)
        try:
            yield
        finally:
            self.cancel(entry)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, entry = heapq.heappop(self._heap)
                sock, fired = entry
                entry[0] = None
            if sock is not None:
                fired.set()
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # already closed by its owner
                    pass


WATCHDOG = _Watchdog()


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server whose clients lost to their own doing (reset, broken pipe, too slow) are counted in
    ``dropped`` with one line each. Subclasses set ``label`` (the log lines' subject) and
    ``connection_timeout_s``."""

    daemon_threads = True
    label = "http server"
    connection_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._drops = threading.Lock()
        self.dropped = 0
        super().__init__(*args, **kwargs)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (reset, broken pipe, timed out) is one line; anything else a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError | TimeoutError):
            self.note_dropped(client_address, f"dropped its connection ({type(exc).__name__})")
            return
        super().handle_error(request, client_address)

    def note_dropped(self, client_address: Any, why: str) -> None:
        """Count a client lost to its own doing, with one line on stderr."""
        with self._drops:
            self.dropped += 1
        log.warning("%s: client %s %s", self.label, peer(client_address), why)


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler whose request and answer each arrive within the server's ``connection_timeout_s``: call
    :meth:`request_read` once the body is read (the work that follows is not bounded here) and answer with
    :meth:`send_json`."""

    server: BoundedServer

    def setup(self) -> None:
        self.deadline_s: float = self.server.connection_timeout_s
        self.timeout = self.deadline_s  # each read and write too (StreamRequestHandler sets it on the socket)
        super().setup()
        self.late = threading.Event()  # set when the request (line, headers, body) did not arrive in time
        self._reading = WATCHDOG.watch(self.connection, time.monotonic() + self.deadline_s, self.late)

    def finish(self) -> None:
        WATCHDOG.cancel(self._reading)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # no per-request stderr lines (headers stay private)
        return

    def request_read(self) -> None:
        """The request has arrived: its deadline no longer applies."""
        WATCHDOG.cancel(self._reading)

    def read_exactly(self, length: int) -> bytes:
        """``length`` body bytes, or fewer when the client closed early; TimeoutError (the client is dropped,
        counted) when the request did not arrive within the deadline."""
        data = self.rfile.read(length) if length else b""
        if len(data) < length and self.late.is_set():
            self.server.note_dropped(self.client_address, f"was too slow: its request did not arrive within "
                                                          f"{self.deadline_s:g} s")
            raise TimeoutError(f"the request did not arrive within {self.deadline_s:g} s")
        return data

    def send_json(self, status: int, body: Any) -> None:
        """Write ``body`` as a JSON answer within ``connection_timeout_s`` in total (a client that does not read,
        or reads too slowly, is cut off: the write raises a ConnectionError, counted as a drop)."""
        data = json.dumps(body).encode()
        with WATCHDOG.guard(self.connection, time.monotonic() + self.deadline_s, threading.Event()):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()


def peer(client_address: Any) -> str:
    """``host:port`` (``[host]:port`` for IPv6) of a client."""
    host, port = client_address[:2]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
