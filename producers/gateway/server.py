"""The gateway's HTTP server: an OpenAI-compatible API in front of the policy (standard library
``ThreadingHTTPServer``, as the reward server; no web framework).

Consumes: HTTP requests from agents using any OpenAI client with ``base_url`` pointed here, and a
:class:`~producers.gateway.service.Gateway` to do the work.
Produces:
- ``POST /v1/chat/completions`` (tools accepted) and ``POST /v1/completions``: one answer, whole or, with
  ``stream: true``, as server-sent events (:mod:`producers.gateway.streaming`: the answer is sampled and recorded
  whole first, then sent as one content delta, its tool calls, its finish reason and, asked for, its usage);
- ``POST /v1/episodes/{episode_id}/end`` with ``{"reward": float}`` (the environment's reward), ``{}`` or
  ``{"answer": ..., "metadata": {...}}`` (the scorer's reward functions score the final state), or
  ``{"failed": "reason"}`` (dead-lettered, never trained), with ``"refill": true`` when another episode of its
  group takes its place (it then does not count toward the group's size); answers as the state endpoint;
- ``GET /v1/episodes/{episode_id}``: ``{"episode_id", "state", "calls", "members", "refills_waiting"}``, its state
  ``new`` (never seen), ``open``, ``ended``, ``published`` or ``dead_lettered``, its group's episodes counted toward
  its size and its refilled ones whose replacement is owed (what a driver checks before playing an episode again);
- ``GET /v1/models`` (the one model name served) and ``GET /health`` (the policy version, ``group_size`` and the
  model name).

The episode id of a call comes from the ``X-Episode-Id`` header, else from the API key (``Authorization: Bearer
<episode id>``, the ``api_key`` of the OpenAI client): the agent is unmodified apart from ``base_url`` and that id.

Guarantees: every refusal is an OpenAI error object (``{"error": {"message", "type", "param", "code"}}``) whose
message names what was wrong: a missing or malformed episode id, an unknown model, a malformed ``stream``, too many
tokens, malformed messages (:mod:`producers.gateway.calls`), a body over ``gateway.max_body_bytes`` (413, refused before it
is read), no Content-Length (411), a path that does not exist (404). An unexpected failure is a 500 with its type
and message; the server itself never dies of a request. A client has ``gateway.connection_timeout_s`` in total to
send its request and again to read the answer, and at most ``gateway.max_connections`` connections are handled at
once, one more answered 503 at once (:mod:`stream_rl.runtime.http_serving`, as the reward server): one
that trickles its request or reads the answer a byte at a time is cut off at the deadline, one warning line and a
count (``GatewayServer.dropped``), and holds no thread past it; the time a call takes to generate is not bounded
by it.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any
from urllib.parse import unquote

from producers.gateway.calls import RequestError
from producers.gateway.episodes import group_of
from producers.gateway.streaming import event_stream, stream_mode
from schemas import ID_PATTERN, PROMPT_ID_MAX_LEN
from stream_rl.runtime.http_serving import BoundedHandler, BoundedServer

log = logging.getLogger(__name__)
_END = re.compile(r"^/v1/episodes/(?P<episode>.+)/end$")  # an id may hold '/' (GROUP/NAME), sent as is or %2F
_EPISODE = re.compile(r"^/v1/episodes/(?P<episode>.+)$")
_CALLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class GatewayServer(BoundedServer):
    """The HTTP server; ``serve_forever()`` in a thread, ``shutdown()`` to stop."""

    request_queue_size = 128
    label = "gateway"
    cap_setting = "gateway.max_connections"

    def __init__(self, gateway, *, host: str, port: int, max_body_bytes: int,
                 connection_timeout_s: float, max_connections: int = 256) -> None:
        self.gateway, self.max_body_bytes = gateway, max_body_bytes
        self.connection_timeout_s, self.max_connections = connection_timeout_s, max_connections
        super().__init__((host, port), _Handler)

    def refusal(self, message: str) -> dict:
        """Over ``gateway.max_connections``: an OpenAI error object, as every refusal of the gateway."""
        return {"error": {"message": message, "type": "server_error", "param": None, "code": "too_many_connections"}}

    @property
    def url(self) -> str:
        """The base URL an OpenAI client takes (``.../v1``)."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


def episode_of(headers: Any) -> str:
    """The episode id of a request: ``X-Episode-Id``, else the API key; RequestError when neither is a valid id."""
    found = headers.get("X-Episode-Id")
    if not found:
        auth = headers.get("Authorization") or ""
        found = auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else ""
    if not found:
        raise RequestError("missing episode id: send it as the X-Episode-Id header or as the API key",
                           status=400, code="missing_episode_id")
    if not ID_PATTERN.match(found):
        raise RequestError(f"malformed episode id {found[:80]!r}: 1-255 characters of A-Z a-z 0-9 . _ : / @ -, "
                           f"starting with a letter or digit", code="bad_episode_id")
    if len(group_of(found)) > PROMPT_ID_MAX_LEN:
        raise RequestError(f"episode id {found[:80]!r}...: its group (the part before the last '/') is longer than "
                           f"{PROMPT_ID_MAX_LEN} characters, the longest prompt id", code="bad_episode_id")
    return found


class _Handler(BoundedHandler):
    server: GatewayServer

    def do_GET(self) -> None:
        self.request_read()
        path = self.path.split("?")[0].rstrip("/")
        if path == "/v1/models":
            name = self.server.gateway.gcfg.model_name
            self.send_json(200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "stream-rl"}]})
        elif path == "/health":
            gateway = self.server.gateway
            self.send_json(200, {"status": "ok", "version": gateway.engine.version,
                                 "group_size": gateway.gcfg.group_size, "model": gateway.gcfg.model_name})
        elif (asked := _EPISODE.match(path)) is not None:
            try:
                episode = episode_of({"X-Episode-Id": unquote(asked.group("episode"))})
            except RequestError as exc:
                self._refuse(exc)
                return
            self.send_json(200, self.server.gateway.state(episode))
        else:
            self._refuse(RequestError(f"no such path {self.path[:80]!r}", status=404, code="not_found"))

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        end = _END.match(path)
        try:
            if end is None and path not in _CALLS:
                raise RequestError(f"no such path {self.path[:80]!r}: POST /v1/chat/completions, /v1/completions "
                                   f"or /v1/episodes/{{id}}/end", status=404, code="not_found")
            body = self._body()  # a client too slow or gone raises out of here: nothing to answer
        except RequestError as exc:
            self._refuse(exc)
            return
        try:
            gateway = self.server.gateway
            if end is not None:
                answer = gateway.end(episode_of({"X-Episode-Id": unquote(end.group("episode"))}), body)
            else:
                stream, include_usage = stream_mode(body)
                answer = gateway.call(_CALLS[path], episode_of(self.headers), body)
                if stream:  # recorded before this first byte, as a whole answer is
                    self.send_bytes(200, event_stream(answer, include_usage), "text/event-stream")
                    return
        except RequestError as exc:
            self._refuse(exc)
            return
        except Exception as exc:  # the server goes on; the agent sees the reason
            log.exception("gateway request failed")
            self._refuse(RequestError(f"{type(exc).__name__}: {str(exc)[:2000]}", status=500, code="server_error"))
            return
        self.send_json(200, answer)

    def _body(self) -> Any:
        declared = self.headers.get("Content-Length")
        if declared is None:
            raise RequestError("a Content-Length is required (chunked bodies are not accepted)", status=411)
        if not declared.strip().isdigit():
            raise RequestError(f"Content-Length {declared[:40]!r} is not a number")
        length = int(declared)
        if length > self.server.max_body_bytes:
            raise RequestError(f"the body of {length} bytes is over gateway.max_body_bytes="
                               f"{self.server.max_body_bytes}", status=413, code="body_too_large")
        raw = self.read_exactly(length)  # TimeoutError when too slow (handle_one_request discards the connection)
        self.request_read()
        if len(raw) < length:
            raise RequestError(f"the body ended after {len(raw)} of {length} bytes")
        try:
            return json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            raise RequestError("the body is not JSON") from None

    def _refuse(self, exc: RequestError) -> None:
        self.send_json(exc.status, exc.body())
