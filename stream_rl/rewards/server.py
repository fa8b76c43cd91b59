"""A reward server: any batch scoring function served over the JSON protocol of :mod:`stream_rl.rewards.http`
(standard library ``ThreadingHTTPServer``; no new dependency), and to OpenRLHF's remote-reward clients.

Consumes: a ``score(prompts, responses, answers, metadatas) -> [value | Exception]`` function (see
:func:`per_rollout_scorer` to serve a per-rollout reward function), a host (loopback by default; an IPv6 address
such as ``::1`` is served on IPv6), a port (0: an ephemeral one) and :class:`ServerLimits`.
Produces: ``POST /`` (and ``POST /get_reward``, OpenRLHF's path) answering ``{"rewards", "token_rewards",
"errors"}``; ``GET /health`` answering 200 ``{"status": "ok", ...}`` while scoring progresses, 503
``{"status": "stuck", "reason": ...}`` while a scoring call has run longer than ``stuck_after_s`` (both with the
calls in flight, waiting and completed, and the connection counts).
Guarantees:
- A request is scored in chunks of at most ``batch_size`` rollouts, at most ``parallel`` chunks at a time per
  server (default 1: a reward model is not run by two threads at once); other requests wait their turn.
- Every value answered is a finite float (or null with its reason): a per-rollout failure, or a value the
  contract refuses (:func:`stream_rl.rewards.contract.check_reward_value`: ``10**400``, NaN, a string), is that
  rollout's ``null`` reward with its reason in ``errors``; a failure of the whole scoring function is a 500 with
  its type and message. The server itself never dies of a request.
- Bad requests get a status and a reason: 400 (not JSON, nested too deeply, a wrong field), 411 (no
  Content-Length), 413 (a body over ``max_body_bytes``, refused before it is read), 404 (another path).
- Load and bad clients: a listen backlog of :data:`LISTEN_BACKLOG`; at most ``max_connections`` connections
  are handled at once (one thread each), any more is answered 503 and closed at once; a client has
  ``connection_timeout_s`` in total to send its request and again to read the answer (the watchdog of
  :mod:`stream_rl.runtime.http_serving`, shared with the gateway, shuts the socket down at the deadline: a slow
  or trickling client loses its connection, not a thread for ever); a client that drops its connection, or is
  dropped for slowness, costs one line on stderr, never a traceback.
- A request in OpenRLHF's shape (``query`` and no ``responses``) is read and answered as
  :mod:`stream_rl.rewards.openrlhf` says: never a null reward (``openrlhf_fallback``, 0.0 by default, instead),
  the reason in ``errors``.
"""

from __future__ import annotations

import itertools
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from stream_rl.rewards.contract import RewardFn, RewardValueError, check_reward_value, error_text
from stream_rl.rewards.http import loads_json
from stream_rl.rewards.openrlhf import Batch, is_openrlhf, openrlhf_answer, parse_openrlhf, strings
from stream_rl.runtime.http_serving import BoundedHandler, BoundedServer

BatchScore = Callable[[list[str], list[str], list["str | None"], list[dict]], list[Any]]
LISTEN_BACKLOG = 128
"""Pending connections the kernel queues (socketserver's default of 5 refused connections under load)."""
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one server accepts; ``stream-rl reward-server`` flags of the same names."""

    max_connections: int = 128
    """Connections handled at once (a thread each); one more is answered 503 and closed."""
    connection_timeout_s: float = 30.0
    """Seconds a client has to send its whole request (line, headers, body), and again to read the answer."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body; a larger one is answered 413 without being read."""
    stuck_after_s: float = 120.0
    """``GET /health`` answers 503 while a scoring call has run longer than this."""

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.connection_timeout_s <= 0 or self.max_body_bytes < 1 \
                or self.stuck_after_s <= 0:
            raise ValueError(f"server limits must be positive: {self}")


def per_rollout_scorer(fn: RewardFn, name: str) -> BatchScore:
    """A batch scorer calling ``fn`` once per rollout; a raising or invalid call is that rollout's Exception."""

    def score(prompts, responses, answers, metadatas):  # lists of B -> list of B
        out: list[Any] = []
        for args in zip(prompts, responses, answers, metadatas):
            try:
                value = fn(*args)  # a dict's token rewards are checked by the client, which knows their count
                out.append(value if isinstance(value, Mapping) else check_reward_value(value, 0, name).reward)
            except RewardValueError as exc:
                out.append(exc)
            except Exception as exc:  # user code failed on this rollout: its reason goes back to the client
                out.append(RuntimeError(f"{name} raised {type(exc).__name__}: {error_text(exc)}"))
        return out

    return score


def parse_request(body: Any) -> Batch:
    """Prompts, responses, answers and metadatas of a request in our shape; ValueError naming the wrong field."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    prompts = strings(body, "prompts")
    responses = strings(body, "responses")
    n = len(prompts)
    answers = body.get("labels") or [None] * n
    metadatas = body.get("metadata") or [{} for _ in range(n)]
    for key, values in (("responses", responses), ("labels", answers), ("metadata", metadatas)):
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"'{key}' must be a list of {n} (one per prompt)")
    if not all(a is None or isinstance(a, str) for a in answers):
        raise ValueError("'labels' must hold strings or nulls")
    if not all(isinstance(m, dict) and all(isinstance(v, str) for v in m.values()) for m in metadatas):
        raise ValueError("'metadata' must hold objects of strings")
    return prompts, responses, answers, metadatas


def encode_answer(values: Sequence[Any], name: str = "the reward function") -> dict[str, Any]:
    """``{"rewards", "token_rewards"?, "errors"?}`` from a scorer's values (floats, reward dicts, Exceptions):
    every reward a finite float or null with its reason."""
    rewards: list[float | None] = []
    tokens: list[list[float] | None] = []
    errors: list[str | None] = []
    for value in values:
        reward, token_rewards, error = _one(value, name)
        rewards.append(reward)
        tokens.append(token_rewards)
        errors.append(error)
    answer: dict[str, Any] = {"rewards": rewards}
    if any(t is not None for t in tokens):
        answer["token_rewards"] = tokens
    if any(e is not None for e in errors):
        answer["errors"] = errors
    return answer


def _one(value: Any, name: str) -> tuple[float | None, list[float] | None, str | None]:
    if isinstance(value, Exception):
        return None, None, error_text(value, limit=2000)
    tokens = value.get("token_rewards") if isinstance(value, Mapping) else None
    count = len(tokens) if isinstance(tokens, list | tuple) else 0  # the client checks the count it expects
    try:
        checked = check_reward_value(value, count, name)
    except RewardValueError as exc:
        return None, None, str(exc)
    return checked.reward, None if checked.token_rewards is None else checked.token_rewards.tolist(), None


class ScoringProgress:
    """Scoring calls in flight and when each started: what ``/health`` reports."""

    def __init__(self, stuck_after_s: float) -> None:
        self.stuck_after_s = stuck_after_s
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}
        self._ids = itertools.count()
        self.completed = 0
        self.waiting = 0

    @contextmanager
    def waiting_turn(self) -> Iterator[None]:
        with self._lock:
            self.waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self.waiting -= 1

    @contextmanager
    def running(self) -> Iterator[None]:
        call = next(self._ids)
        with self._lock:
            self._started[call] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                del self._started[call]
                self.completed += 1

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "stuck", "reason"?, "in_flight", "waiting", "completed", "oldest_call_s"}``."""
        with self._lock:
            oldest = time.monotonic() - min(self._started.values()) if self._started else 0.0
            report: dict[str, Any] = {"status": "ok", "in_flight": len(self._started), "waiting": self.waiting,
                                      "completed": self.completed, "oldest_call_s": round(oldest, 3)}
        if oldest > self.stuck_after_s:
            report["status"] = "stuck"
            report["reason"] = (f"a scoring call has been running for {oldest:.1f} s, over the "
                                f"{self.stuck_after_s:g} s limit (--stuck-after-s): scoring does not progress")
        return report


class RewardServer(BoundedServer):
    """The HTTP server; ``serve_forever()`` in a thread or the foreground, ``shutdown()`` to stop."""

    request_queue_size = LISTEN_BACKLOG
    label = "reward server"
    cap_setting = "--max-connections"

    def __init__(self, score: BatchScore, *, name: str, host: str = "127.0.0.1", port: int = 0,
                 batch_size: int = 64, parallel: int = 1, limits: ServerLimits = ServerLimits(),
                 openrlhf_fallback: float = 0.0) -> None:
        if batch_size < 1 or parallel < 1:
            raise ValueError(f"batch_size and parallel must be >= 1, got {batch_size}, {parallel}")
        self.score, self.name, self.batch_size, self.limits = score, name, batch_size, limits
        if not math.isfinite(openrlhf_fallback):
            raise ValueError(f"openrlhf_fallback must be a finite number, got {openrlhf_fallback}")
        self.openrlhf_fallback = float(openrlhf_fallback)
        self.lock = threading.BoundedSemaphore(parallel)
        self.progress = ScoringProgress(limits.stuck_after_s)
        self.connection_timeout_s = limits.connection_timeout_s
        self.max_connections = limits.max_connections
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"

    def score_all(self, prompts, responses, answers, metadatas) -> list[Any]:
        out: list[Any] = []
        for i in range(0, len(prompts), self.batch_size):
            part = slice(i, i + self.batch_size)
            with self.progress.waiting_turn():
                self.lock.acquire()
            try:
                with self.progress.running():
                    values = self.score(prompts[part], responses[part], answers[part], metadatas[part])
            finally:
                self.lock.release()
            if len(values) != len(prompts[part]):
                raise RuntimeError(f"{self.name} returned {len(values)} values for {len(prompts[part])} rollouts")
            out.extend(values)
        return out

    def score_some(self, batch: Batch, failed: Mapping[int, Exception]) -> list[Any]:
        """``score_all`` of the rollouts not in ``failed``, with each failed one's Exception in its place."""
        keep = [i for i in range(len(batch[0])) if i not in failed]
        scored = iter(self.score_all(*([column[i] for i in keep] for column in batch)) if keep else [])
        return [failed[i] if i in failed else next(scored) for i in range(len(batch[0]))]

class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class _Handler(BoundedHandler):
    server: RewardServer

    def do_GET(self) -> None:
        self.request_read()
        if self.path.rstrip("/") == "/health":
            report = {**self.server.progress.health(), "served": self.server.name,
                      "connections": self.server.connection_counts()}
            self.send_json(200 if report["status"] == "ok" else 503, report)
        else:
            self.send_json(404, {"error": f"no such path {self.path!r}; POST / or GET /health"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") not in ("", "/get_reward"):
            self.send_json(404, {"error": f"no such path {self.path!r}; POST / or POST /get_reward"})
            return
        try:
            raw = self._read_body()
            self.request_read()
            body = loads_json(raw)
            openrlhf = is_openrlhf(body)
            batch, failed = parse_openrlhf(body) if openrlhf else (parse_request(body), {})
        except _Refused as refused:
            self.send_json(refused.status, {"error": str(refused)})
            return
        except ValueError as exc:  # not JSON (or not UTF-8), nested too deeply, a wrong field
            self.send_json(400, {"error": f"bad request: {exc}"})
            return
        try:
            values = self.server.score_some(batch, failed)
        except Exception as exc:  # the whole scoring failed: a 500 with the reason, the server goes on
            self.send_json(500, {"error": f"{type(exc).__name__}: {error_text(exc, 2000)}"})
            return
        name = self.server.name
        answer = encode_answer(values, name)
        self.send_json(200, openrlhf_answer(answer, self.server.openrlhf_fallback) if openrlhf else answer)

    def _read_body(self) -> bytes:
        """The request body (the request as a whole arrives within ``connection_timeout_s``); _Refused for a length
        we refuse; TimeoutError (the client is dropped) when it is too slow."""
        declared = self.headers.get("Content-Length")
        if declared is None:
            raise _Refused(411, "a Content-Length is required (chunked bodies are not accepted)")
        if not declared.strip().isdigit():
            raise _Refused(400, f"bad request: Content-Length {declared[:40]!r} is not a number")
        length, limit = int(declared), self.server.limits.max_body_bytes
        if length > limit:
            raise _Refused(413, f"the body of {length} bytes is over the server's limit of {limit} bytes")
        if length == 0:
            raise _Refused(400, "bad request: the body is empty")
        data = self.read_exactly(length)  # TimeoutError when too slow (handle_one_request discards the connection)
        if len(data) < length:
            raise _Refused(400, f"bad request: the body ended after {len(data)} of {length} bytes")
        return data
