"""Liveness and readiness of a role process, served over HTTP: ``/healthz``, ``/readyz`` and ``/metrics``.

Consumes: what the role loop and the telemetry threads report into a :class:`HealthState` (loop ticks, broker
acknowledgements, model loaded, weights version), and the Prometheus text of :class:`RoleMetrics`.
Produces: a daemon-thread ``ThreadingHTTPServer`` bound to ``http_host:http_port`` (127.0.0.1 by default; port 0 picks
a free one) and ``run_dir/endpoints/<instance_id>.json`` = ``{"role", "instance_id", "url", "pid", "host"}``, removed
again by ``close`` (a role that stops cleanly leaves no endpoint file behind; one killed outright does, and
``stream-rl status`` marks it stale).
Guarantees (pure :func:`readiness` / :func:`liveness` over a snapshot)::

    /healthz  200  <=>  the loop ticked within liveness_timeout_s
    /readyz   200  <=>  broker acknowledged within broker_timeout_s  and  model loaded  and  weights version >= 0
    otherwise 503 with {"ready": false, "not_ready": ["broker unreachable: ...", "model not loaded", ...]}
    /metrics  200 text/plain (Prometheus exposition) with exporter prometheus, else 404

The server never touches the loop's objects: it reads a snapshot under a lock.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class HealthSnapshot:
    """What readiness and liveness are judged on (monotonic seconds; None = never)."""

    last_tick: float | None = None
    broker_ok_at: float | None = None
    broker_error: str | None = None
    model_loaded: bool = False
    version: int = -1


def liveness(snap: HealthSnapshot, now: float, timeout_s: float) -> tuple[bool, list[str]]:
    """Alive while the loop ticked within ``timeout_s``."""
    if snap.last_tick is None:
        return False, ["loop has not started"]
    age = now - snap.last_tick
    return (True, []) if age <= timeout_s else (False, [f"loop last ticked {age:.1f}s ago (> {timeout_s:g}s)"])


def readiness(snap: HealthSnapshot, now: float, broker_timeout_s: float) -> tuple[bool, list[str]]:
    """Ready when the broker acknowledged recently, the model is loaded and the weights version is known."""
    problems = []
    if snap.broker_ok_at is None or now - snap.broker_ok_at > broker_timeout_s:
        why = snap.broker_error or ("no acknowledgement yet" if snap.broker_ok_at is None
                                    else f"last acknowledgement {now - snap.broker_ok_at:.1f}s ago")
        problems.append(f"broker unreachable: {why}")
    if not snap.model_loaded:
        problems.append("model not loaded")
    if snap.version < 0:
        problems.append("weights version unknown")
    return not problems, problems


class HealthState:
    """Thread-safe holder of the health facts; the loop writes, the HTTP threads read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap = HealthSnapshot()

    def update(self, **changes) -> None:
        with self._lock:
            self._snap = replace(self._snap, **changes)

    def tick(self) -> None:
        self.update(last_tick=time.monotonic())  # under the lock: an unlocked copy could undo a heartbeat's update

    def broker_ok(self) -> None:
        self.update(broker_ok_at=time.monotonic(), broker_error=None)

    def broker_failed(self, error: str) -> None:
        self.update(broker_ok_at=None, broker_error=error)

    def snapshot(self) -> HealthSnapshot:
        with self._lock:
            return self._snap


class HealthServer:
    """The HTTP endpoint of one process (stdlib server on a daemon thread)."""

    def __init__(self, state: HealthState, host: str, port: int, *, liveness_timeout_s: float,
                 broker_timeout_s: float, metrics_text: Callable[[], bytes | None]):
        handler = _handler_class(state, liveness_timeout_s, broker_timeout_s, metrics_text)
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.host, self.port = host, int(self.server.server_address[1])
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name=f"health-{self.port}", daemon=True)
        self._thread.start()
        self.recorded: Path | None = None

    def record(self, directory: Path, role: str, instance_id: str) -> Path:
        """Write ``directory/<instance_id>.json`` naming this endpoint (tmp + rename)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{instance_id}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"role": role, "instance_id": instance_id, "url": self.url, "pid": os.getpid(),
                                   "host": socket.gethostname()}, sort_keys=True))
        os.replace(tmp, path)
        self.recorded = path
        return path

    def close(self) -> None:
        """Stop serving, then remove the endpoint file this server recorded (when it still names this server)."""
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5.0)
        path, self.recorded = self.recorded, None
        if path is not None:
            _remove_own_record(path, self.url)


def _remove_own_record(path: Path, url: str) -> None:
    """Delete ``path`` unless it is gone or another process has since recorded itself there (same instance id)."""
    try:
        named = json.loads(path.read_text())
    except (OSError, ValueError):  # gone, or unreadable: ours was written atomically, so that one is not ours
        return
    if isinstance(named, dict) and named.get("url") == url and named.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def _handler_class(state: HealthState, liveness_timeout_s: float, broker_timeout_s: float,
                   metrics_text: Callable[[], bytes | None]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            path = self.path.split("?", 1)[0]
            now = time.monotonic()
            if path == "/healthz":
                ok, problems = liveness(state.snapshot(), now, liveness_timeout_s)
                self._json(200 if ok else 503, {"alive": ok, "problems": problems})
            elif path == "/readyz":
                ok, problems = readiness(state.snapshot(), now, broker_timeout_s)
                self._json(200 if ok else 503, {"ready": ok, "not_ready": problems})
            elif path == "/metrics" and (text := metrics_text()) is not None:
                self._send(200, "text/plain; version=0.0.4; charset=utf-8", text)
            else:
                self._json(404, {"error": f"no such endpoint: {path}"})

        def _json(self, code: int, body: dict) -> None:
            self._send(code, "application/json", json.dumps(body).encode())

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: keep the log quiet
            return None

    return Handler
