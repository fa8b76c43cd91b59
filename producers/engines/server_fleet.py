"""Which inference server gets the next request: a fleet with least-outstanding-requests routing and health.

Consumes: the servers' base URLs (``producer.server.urls``, and the lines of ``producer.server.urls_file``, re-read
as it changes), and the outcome of every request (done with its token count, or failed).
Produces: the server for each request (:meth:`Fleet.acquire`), and a snapshot per server (health, outstanding
requests, requests and tokens done, the version it holds, the last error) for metrics and ``stream-rl status``.
Guarantees:
- ``acquire`` picks a healthy server that holds the engine's version and has a free slot, with the fewest
  outstanding requests (ties: the one with the fewest requests done, then URL order); it never hands out a server
  marked down or one still being brought to the current version.
- A server marked down (:meth:`mark_down`, on a connection error, a timeout or a 5xx answer) gets no request until
  :meth:`revive` says it is back at the current version; the engine re-issues the request it lost elsewhere.
- A URL that appears in ``urls_file`` joins as *new* (not yet at any version); one that disappears is retired
  once its outstanding requests end. Pure bookkeeping under one lock: no I/O, testable without servers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ServerState:
    """One server as the fleet sees it."""

    url: str
    healthy: bool = False          # answered, and holds `version`
    version: int | None = None     # the policy version it holds (None: not brought to any yet)
    outstanding: int = 0
    requests: int = 0
    tokens: int = 0
    failures: int = 0
    last_error: str = ""
    retired: bool = False          # gone from the URL list: finishes what it has, gets nothing new

    def snapshot(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "version": self.version, "outstanding": self.outstanding,
                "requests": self.requests, "tokens": self.tokens, "failures": self.failures,
                "last_error": self.last_error}


@dataclass
class Fleet:
    """The servers of one ``server`` engine (see the module guarantees)."""

    urls: list[str]
    max_outstanding: int = 64
    servers: dict[str, ServerState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Condition()
        for url in self.urls:
            self.servers.setdefault(url, ServerState(url))

    def acquire(self, version: int, exclude: frozenset[str] = frozenset()) -> str | None:
        """The URL of the server for the next request at ``version`` (one outstanding request more), or None
        when no healthy server at ``version`` has a free slot (``exclude``: URLs this request already failed on,
        used only while another server can take it)."""
        with self._lock:
            ready = [s for s in self.servers.values() if s.healthy and not s.retired and s.version == version
                     and s.outstanding < self.max_outstanding]
            preferred = [s for s in ready if s.url not in exclude] or ready
            if not preferred:
                return None
            best = min(preferred, key=lambda s: (s.outstanding, s.requests, s.url))
            best.outstanding += 1
            return best.url

    def release(self, url: str, tokens: int = 0, ok: bool = True) -> None:
        """A request on ``url`` ended (``ok``: with ``tokens`` sampled tokens)."""
        with self._lock:
            server = self.servers[url]
            server.outstanding -= 1
            if ok:
                server.requests += 1
                server.tokens += tokens
            if server.retired and server.outstanding == 0:
                del self.servers[url]
            self._lock.notify_all()

    def mark_down(self, url: str, reason: str) -> None:
        """``url`` failed (connection, timeout, 5xx): no more requests until :meth:`revive`."""
        with self._lock:
            server = self.servers.get(url)
            if server is not None:
                server.healthy = False
                server.failures += 1
                server.last_error = reason[:300]
                self._lock.notify_all()

    def revive(self, url: str, version: int) -> None:
        """``url`` answered and now holds ``version``: it gets requests again."""
        with self._lock:
            server = self.servers.get(url)
            if server is not None and not server.retired:
                server.healthy, server.version = True, version
                self._lock.notify_all()

    def set_version(self, url: str, version: int) -> None:
        """``url`` loaded ``version`` (it stays healthy)."""
        with self._lock:
            if url in self.servers:
                self.servers[url].version = version

    def update_urls(self, urls: list[str]) -> list[str]:
        """Make the URL list ``urls``: new ones join (returned, to be brought to the current version), missing
        ones retire."""
        with self._lock:
            added = [url for url in urls if url not in self.servers]
            for url in added:
                self.servers[url] = ServerState(url)
            for url, server in list(self.servers.items()):
                if url not in urls:
                    server.retired, server.healthy = True, False
                    if server.outstanding == 0:
                        del self.servers[url]
            self.urls = list(urls)
            self._lock.notify_all()
            return added

    def wait(self, timeout: float) -> None:
        """Sleep until a request ends or a server's health changes, or ``timeout`` seconds."""
        with self._lock:
            self._lock.wait(timeout)

    def unhealthy(self) -> list[str]:
        """URLs not taking requests (down, or never brought to a version)."""
        with self._lock:
            return [url for url, s in self.servers.items() if not s.healthy and not s.retired]

    def healthy_urls(self) -> list[str]:
        with self._lock:
            return [url for url, s in self.servers.items() if s.healthy and not s.retired]

    def snapshot(self) -> list[dict]:
        """Per-server state, in URL order."""
        with self._lock:
            return [self.servers[url].snapshot() for url in sorted(self.servers)]


def read_urls_file(path: Path) -> list[str]:
    """The URLs in ``path``: one per line; blank lines and ``#`` comments skipped; a missing file is empty."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return list(dict.fromkeys(line.rstrip("/") for line in lines if line))


def fleet_metrics(snapshot: list[dict]) -> dict[str, float]:
    """Heartbeat metrics of a fleet snapshot: ``servers/total``, ``servers/healthy``, ``servers/outstanding`` and,
    per server ``i`` in URL order, ``servers/i/{healthy, outstanding, requests, tokens, failures, version}``
    (``stream-rl status`` shows them per producer)."""
    out = {"servers/total": float(len(snapshot)), "servers/healthy": float(sum(s["healthy"] for s in snapshot)),
           "servers/outstanding": float(sum(s["outstanding"] for s in snapshot))}
    for i, server in enumerate(snapshot):
        for key in ("healthy", "outstanding", "requests", "tokens", "failures"):
            out[f"servers/{i}/{key}"] = float(server[key])
        out[f"servers/{i}/version"] = float(-1 if server["version"] is None else server["version"])
    return out
