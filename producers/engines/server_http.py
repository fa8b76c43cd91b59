"""JSON over HTTP to one inference server, with the two kinds of failure the ``server`` engine tells apart.

Consumes: a server's base URL (``http://host:port``), a method, a path and a JSON body.
Produces: the decoded JSON answer, or raises :class:`ServerDown` (the server cannot answer: connection refused or
reset, a timeout, a 5xx answer, an answer that is not JSON or is larger than ``MAX_ANSWER_BYTES``) or
:class:`ServerRefused` (a 4xx answer: the request itself is wrong, re-issuing it elsewhere would not help).
Guarantees: every call has a deadline (``timeout_s``, for connecting and for each read); redirects are not
followed (``http.client`` never follows them; a 3xx is a refusal); the answer read is bounded; nothing but JSON
is decoded. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import socket
from urllib.parse import urlsplit

MAX_ANSWER_BYTES = 256 * 1024 * 1024


class ServerDown(RuntimeError):
    """The server did not answer usably; another server may (retriable elsewhere)."""


class ServerRefused(RuntimeError):
    """The server answered 3xx/4xx: it refuses this request (``status``, and its message)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def check_url(url: str) -> str:
    """``url`` without a trailing slash, or ValueError naming what is wrong (scheme, host, port, a path)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: a server URL starts with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"{url!r} has no host")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from exc
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r}: give the server's base URL (scheme, host and port only)")
    return url.rstrip("/")


def call(url: str, method: str, path: str, body: object | None = None, timeout_s: float = 30.0) -> object:
    """``method path`` on the server at ``url`` with ``body`` as JSON; the decoded JSON answer (None when empty)."""
    parts = urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout_s)
    payload = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"} if payload is not None else {}
    try:
        conn.request(method, path, body=payload, headers=headers)
        answer = conn.getresponse()
        raw = answer.read(MAX_ANSWER_BYTES + 1)
    except (OSError, socket.timeout, http.client.HTTPException) as exc:
        raise ServerDown(f"{method} {url}{path}: {type(exc).__name__}: {exc}") from exc
    finally:
        conn.close()
    if len(raw) > MAX_ANSWER_BYTES:
        raise ServerDown(f"{method} {url}{path}: answer larger than {MAX_ANSWER_BYTES} bytes")
    text = raw.decode("utf-8", errors="replace")
    if answer.status >= 500:
        raise ServerDown(f"{method} {url}{path}: HTTP {answer.status}: {_message(text)}")
    if answer.status >= 300:
        raise ServerRefused(answer.status, _message(text))
    if not raw.strip():
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ServerDown(f"{method} {url}{path}: the answer is not JSON ({text[:120]!r})") from exc


def _message(text: str) -> str:
    """The error message of an OpenAI/FastAPI-shaped error body, else the start of the text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict):
            return str(error.get("message", error))[:300]
        return str(error)[:300]
    return text[:300]
