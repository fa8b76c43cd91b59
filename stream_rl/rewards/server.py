"""A reward server: any batch scoring function served over the JSON protocol of :mod:`stream_rl.rewards.http`
(standard library ``ThreadingHTTPServer``; no new dependency).

Consumes: a ``score(prompts, responses, answers, metadatas) -> [value | Exception]`` function (see
:func:`per_rollout_scorer` to serve a per-rollout reward function), a host (loopback by default) and a port (0:
an ephemeral one).
Produces: ``POST /`` (and ``POST /get_reward``, OpenRLHF's path) answering ``{"rewards", "token_rewards",
"errors"}``; ``GET /health`` answering ``{"status": "ok", "served": <name>}``.
Guarantees:
- A request is scored in chunks of at most ``batch_size`` rollouts, at most ``parallel`` chunks at a time per
  server (default 1: a reward model is not run by two threads at once); other requests wait their turn.
- A per-rollout failure is that rollout's ``null`` reward with its reason in ``errors``; a malformed request is
  answered 400 with the reason; a failure of the whole scoring function 500 with its type and message. The
  server itself never dies of a request. A request without ``responses`` but with ``query`` and ``prompts``
  (OpenRLHF's shape) takes each response as the query with its prompt prefix removed.
"""

from __future__ import annotations

import json
import math
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stream_rl.rewards.contract import RewardFn, RewardValueError, check_reward_value

BatchScore = Callable[[list[str], list[str], list["str | None"], list[dict]], list[Any]]
MAX_BODY = 64 * 1024 * 1024


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
                out.append(RuntimeError(f"{name} raised {type(exc).__name__}: {exc}"))
        return out

    return score


def parse_request(body: Any) -> tuple[list[str], list[str], list[str | None], list[dict]]:
    """Prompts, responses, answers and metadatas of a request body; ValueError naming the field that is wrong."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    prompts = _strings(body, "prompts")
    if "responses" in body:
        responses = _strings(body, "responses")
    else:
        queries = _strings(body, "query")
        if len(queries) != len(prompts) or not all(q.startswith(p) for q, p in zip(queries, prompts)):
            raise ValueError("without 'responses', each 'query' must be its prompt followed by the response")
        responses = [q[len(p):] for q, p in zip(queries, prompts)]
    n = len(prompts)
    answers = body.get("labels") or [None] * n
    metadatas = body.get("metadata") or [{} for _ in range(n)]
    for key, values in (("responses", responses), ("labels", answers), ("metadata", metadatas)):
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"'{key}' must be a list of {n} (one per prompt)")
    if not all(a is None or isinstance(a, str) for a in answers):
        raise ValueError("'labels' must hold strings or nulls")
    if not all(isinstance(m, dict) for m in metadatas):
        raise ValueError("'metadata' must hold objects")
    return prompts, responses, answers, metadatas


def _strings(body: dict, key: str) -> list[str]:
    values = body.get(key)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"'{key}' must be a list of strings")
    return values


def encode_answer(values: Sequence[Any]) -> dict[str, Any]:
    """``{"rewards", "token_rewards"?, "errors"?}`` from a scorer's values (floats, reward dicts, Exceptions)."""
    rewards: list[float | None] = []
    tokens: list[list[float] | None] = []
    errors: list[str | None] = []
    for value in values:
        reward, token_rewards, error = _one(value)
        rewards.append(reward)
        tokens.append(token_rewards)
        errors.append(error)
    answer: dict[str, Any] = {"rewards": rewards}
    if any(t is not None for t in tokens):
        answer["token_rewards"] = tokens
    if any(e is not None for e in errors):
        answer["errors"] = errors
    return answer


def _one(value: Any) -> tuple[float | None, list[float] | None, str | None]:
    if isinstance(value, Exception):
        return None, None, str(value)
    if isinstance(value, Mapping):
        try:
            tokens = value.get("token_rewards")
            return float(value["reward"]), None if tokens is None else [float(t) for t in tokens], None
        except (KeyError, TypeError, ValueError) as exc:
            return None, None, f"the reward function returned an unusable dict: {type(exc).__name__}: {exc}"
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value), None, None
    return None, None, f"the reward function returned {value!r}, not a finite number"


class RewardServer(ThreadingHTTPServer):
    """The HTTP server; ``serve_forever()`` in a thread or the foreground, ``shutdown()`` to stop."""

    daemon_threads = True

    def __init__(self, score: BatchScore, *, name: str, host: str = "127.0.0.1", port: int = 0,
                 batch_size: int = 64, parallel: int = 1) -> None:
        if batch_size < 1 or parallel < 1:
            raise ValueError(f"batch_size and parallel must be >= 1, got {batch_size}, {parallel}")
        self.score, self.name, self.batch_size = score, name, batch_size
        self.lock = threading.BoundedSemaphore(parallel)
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def score_all(self, prompts, responses, answers, metadatas) -> list[Any]:
        out: list[Any] = []
        for i in range(0, len(prompts), self.batch_size):
            part = slice(i, i + self.batch_size)
            with self.lock:
                values = self.score(prompts[part], responses[part], answers[part], metadatas[part])
            if len(values) != len(prompts[part]):
                raise RuntimeError(f"{self.name} returned {len(values)} values for {len(prompts[part])} rollouts")
            out.extend(values)
        return out


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer

    def log_message(self, format: str, *args: Any) -> None:  # no per-request stderr lines (headers stay private)
        return

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok", "served": self.server.name})
        else:
            self._send(404, {"error": f"no such path {self.path!r}; POST / or GET /health"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") not in ("", "/get_reward"):
            self._send(404, {"error": f"no such path {self.path!r}; POST / or POST /get_reward"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 < length <= MAX_BODY:
                raise ValueError(f"Content-Length must be 1..{MAX_BODY}, got {length}")
            batch = parse_request(json.loads(self.rfile.read(length)))
        except (ValueError, json.JSONDecodeError) as exc:
            self._send(400, {"error": f"bad request: {exc}"})
            return
        try:
            answer = encode_answer(self.server.score_all(*batch))
        except Exception as exc:  # the whole scoring failed: a 500 with the reason, the server goes on
            self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._send(200, answer)

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
