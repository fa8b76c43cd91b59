"""The driver's side of the gateway's HTTP API: its health, an episode's state, an episode's end.

Consumes: the gateway's base URL (``.../v1``).
Produces: :class:`GatewayClient` (``health()``, ``state(episode_id)``, ``end(episode_id, body)``), each a decoded
JSON answer.
Guarantees: every request is bounded (``timeout_s`` each); only the retriable failures (no connection, a timeout,
a 503 of a gateway over its connection cap) are retried, with doubling backoff, at most ``attempts`` times; any
other answer, and the last failure, raise :class:`GatewayUnavailable` naming the URL and the reason (an error
object's message when the gateway sent one).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote


class GatewayUnavailable(RuntimeError):
    """The gateway did not answer as it should; ``str()`` names the URL and why, ``status`` its HTTP status (None:
    no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class GatewayClient:
    def __init__(self, base_url: str, *, timeout_s: float = 60.0, attempts: int = 5, backoff_s: float = 0.5):
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.attempts, self.backoff_s = attempts, backoff_s

    def health(self, attempts: int | None = None) -> dict[str, Any]:
        """``{"status", "version", "group_size", "model"}`` (GatewayUnavailable when the answer lacks one: the URL
        is not a stream-rl gateway's)."""
        url = self.base_url.removesuffix("/v1") + "/health"
        answer = self._request("GET", url, attempts=attempts)
        return _checked(answer, url, {"version": int, "group_size": int, "model": str})

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """:meth:`health` once the gateway answers (it serves only after replaying its topic), polling for up to
        ``timeout_s``; GatewayUnavailable after that."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.health(attempts=1)
            except GatewayUnavailable as exc:
                if exc.status is not None or time.monotonic() >= deadline:  # it answered, wrongly: no use waiting
                    raise
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def state(self, episode_id: str) -> dict[str, Any]:
        """``{"episode_id", "state", "calls", "members", "refills_waiting"}``: its state ``new``, ``open``,
        ``ended``, ``published`` or ``dead_lettered``, its group's episodes counted toward the group size and its
        refilled ones whose replacement is owed."""
        url = f"{self.base_url}/episodes/{quote(episode_id, safe='')}"
        return _checked(self._request("GET", url), url, {"state": str, "members": int, "refills_waiting": int})

    def end(self, episode_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """End an episode (``{"reward": r, "metadata": {...}}`` or ``{"failed": reason, "refill": bool}``)."""
        return self._request("POST", f"{self.base_url}/episodes/{quote(episode_id, safe='')}/end", body)

    def _request(self, method: str, url: str, body: dict[str, Any] | None = None,
                 attempts: int | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        delay, last, attempts = self.backoff_s, "", attempts or self.attempts
        for attempt in range(attempts):
            if attempt:
                time.sleep(delay)
                delay *= 2
            request = urllib.request.Request(url, data=data, method=method,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                    return json.loads(answer.read())
            except urllib.error.HTTPError as exc:
                if exc.code != 503:
                    raise GatewayUnavailable(f"{method} {url}: HTTP {exc.code}: {_message(exc)}", exc.code) from None
                last = "HTTP 503 (over its connection cap)"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            except ValueError:
                raise GatewayUnavailable(f"{method} {url}: the answer is not JSON") from None
        raise GatewayUnavailable(f"{method} {url}: no answer after {attempts} attempts: {last}")


def _checked(answer: Any, url: str, fields: dict[str, type]) -> dict[str, Any]:
    """``answer`` when it is an object holding ``fields`` of their types, else GatewayUnavailable naming the URL."""
    wrong = [name for name, kind in fields.items()
             if not isinstance(answer, dict) or type(answer.get(name)) is not kind]
    if wrong:
        raise GatewayUnavailable(f"GET {url}: not a stream-rl gateway's answer (no {', '.join(wrong)} of the "
                                 f"expected type; is driver.gateway_url a gateway?)", 200)
    return answer


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read())["error"]["message"])[:500]
    except (ValueError, KeyError, TypeError, OSError):
        return exc.reason if isinstance(exc.reason, str) else "no error object"
