"""Deadlines on sockets, and the bounded request handler that the reward server
(:mod:`stream_rl.rewards.server`) and the gateway (:mod:`producers.gateway.server`) both serve with (standard
library only).

Consumes: a socket and a deadline (:data:`WATCHDOG`); for :class:`BoundedHandler`, a server with a
``connection_timeout_s`` attribute (seconds) and, for :class:`BoundedServer`, a name for its log lines.
Produces: :data:`WATCHDOG`, one daemon thread per process that shuts a socket down at its deadline (the reward
client's exchanges use it too: :mod:`stream_rl.rewards.http`); :class:`BoundedHandler`, whose :meth:`send_json`
writes one JSON answer; :class:`BoundedServer`, which caps the connections handled at once and counts and logs
dropped clients.

One connection::

    accepted ─► request line, headers, body ─► request_read() ─► the work ─► send_json(): head and body
                └─ connection_timeout_s ──┘                    (unbounded)       └─ connection_timeout_s ┘

Guarantees: a client has ``connection_timeout_s`` in total to send its request and again to read the answer; at a
deadline the watchdog shuts the socket down, which wakes the blocked read or write: a client that trickles its
request, or reads the answer a byte at a time, loses its connection, not a thread for ever (a socket timeout per
read and write alone would not bound it: each byte resets it). The time the work takes is not bounded here. A
client that drops its connection, or is dropped, costs one warning line and a count (``dropped``), never a
traceback. A connection over ``max_connections`` is answered 503 at once by the accepting thread and closed:
a client that opens connections by the thousand costs no thread for any of them.
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
    """A threading HTTP server that handles at most ``max_connections`` connections at once (one more is answered
    503 at once, without a thread, naming ``cap_setting``, and counted in ``refused``) and whose clients lost to
    their own doing (reset, broken pipe, too slow) are counted in ``dropped`` with one line each. Subclasses set
    ``label`` (the log lines' subject), ``cap_setting``, ``connection_timeout_s`` and ``max_connections``."""

    daemon_threads = True
    label = "http server"
    cap_setting = "max_connections"
    connection_timeout_s = 30.0
    max_connections = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._drops = threading.Lock()
        self.dropped = 0
        self._connections = threading.Lock()
        self.active = self.peak = self.refused = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections:
            refuse = self.active >= self.max_connections
            if refuse:
                self.refused += 1
            else:
                self.active += 1
                self.peak = max(self.peak, self.active)
        if refuse:
            _refuse(request, self.refusal(f"the server handles {self.max_connections} connections at once "
                                          f"({self.cap_setting}); retry"))
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread, which releases the slot when done
        except Exception:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def refusal(self, message: str) -> Any:
        """The JSON body of the 503 answer to a connection over the cap (subclasses give their API's error shape)."""
        return {"error": message}

    def connection_counts(self) -> dict[str, int]:
        """``{"active", "peak", "refused", "dropped"}``: connections handled now, at most at once, refused over the
        cap, and dropped by their client (or for slowness)."""
        with self._connections:
            return {"active": self.active, "peak": self.peak, "refused": self.refused, "dropped": self.dropped}

    def _release(self) -> None:
        with self._connections:
            self.active -= 1

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
        self.timeout = self.deadline_s  # type: ignore[misc]  # per connection: StreamRequestHandler.setup() puts it on the socket
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
        self.send_bytes(status, json.dumps(body).encode(), "application/json")

    def send_bytes(self, status: int, data: bytes, content_type: str) -> None:
        """Write ``data`` as the answer, under the same deadline as :meth:`send_json`."""
        with WATCHDOG.guard(self.connection, time.monotonic() + self.deadline_s, threading.Event()):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()


def _refuse(request: socket.socket, answer: Any) -> None:
    """Answer 503 with the JSON ``answer`` on a connection over the cap, without a thread (what it sent is
    discarded)."""
    body = json.dumps(answer)
    head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    try:
        request.settimeout(0)
        while request.recv(65536):  # what has arrived, so that closing sends FIN rather than RST
            pass
    except OSError:
        pass
    try:
        request.settimeout(1.0)
        request.sendall((head + body).encode())
    except OSError:  # it went away first
        pass


def peer(client_address: Any) -> str:
    """``host:port`` (``[host]:port`` for IPv6) of a client."""
    host, port = client_address[:2]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
