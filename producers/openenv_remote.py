"""OpenEnv environments served over the network as producer environments, one WebSocket session per rollout.

Consumes: ``producer.environment = "openenv+http://HOST:PORT"`` (``https``, ``ws`` and ``wss`` as well), the URL of
a running OpenEnv server: openenv-core's own FastAPI app (``create_app``/``create_fastapi_app`` under uvicorn, a
Docker image, a Hugging Face Space someone started). Its ``/health``, ``/schema`` and ``/metadata`` are read at
start-up; episodes speak OpenEnv's session protocol on ``/ws``.
Produces: :func:`remote_factory`, a factory of :class:`RemoteOpenEnvEpisode` objects with the producer's environment
interface (:mod:`producers.environment`), one server session per rollout:

    reset(prompt)      -> {"type": "reset", "data": {"seed": <from the prompt id and epoch>, "episode_id": ...}}
    step(policy_text)  -> {"type": "step", "data": {<the action's text field>: policy_text}}
                       <- {"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}
    close()            -> {"type": "close"}, then the socket is closed (the server frees the session)

with the action's text field and the reply taken as for an in-process OpenEnv class (:mod:`producers.hub_envs`):
the action's first string field in the server's ``/schema``, the observation's first string field (else its fields
as bounded JSON); the step's ``reward`` is summed into the rollout's ``episode_reward``.
Guarantees:
- At start-up a server that does not answer ``/health`` with 200 within 10 s, a ``/schema`` that names no action
  with a string field, or a URL that is not http(s)/ws(s) is refused with :class:`EnvironmentLoadError`, one line
  naming ``producer.environment``, the URL (credentials masked) and what failed.
- Every answer is bounded: a WebSocket message over 16 MiB, one that is not JSON, an error answer, or an answer that
  is not an observation fails the episode with :class:`RemoteEnvironmentError` (the server's message, at most 300
  characters); a reward that is not a finite number fails it as any environment's does (``Observation``'s check).
  Its group is played again or dead-lettered (:mod:`producers.multiturn`).
- Each call waits at most ``producer.env_timeout_s`` for its answer (the socket's own deadline, under the same
  :class:`~producers.environment.Guarded` deadline as any environment); a server that dies mid-episode fails it
  with the socket's reason.
- A session is closed when its play ends, played out or failed (timed-out calls included), so the server's session
  cap (``max_concurrent_envs``) is never used up by finished episodes.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

from producers.environment import REMOTE_PREFIX as PREFIX
from producers.environment import EnvironmentLoadError, EnvironmentTimeout, Observation
from producers.hub_envs import episode_seed, observation_text
from schemas import Prompt
from stream_rl.rewards.http import HttpRewardError, exchange, loads_json, safe_url

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
START_TIMEOUT_S = 10.0
CLOSE_WAIT_S = 2.0
_REASON_CHARS = 300


class RemoteEnvironmentError(RuntimeError):
    """The OpenEnv server answered something that is not an observation (an error, bad JSON, another type)."""


def remote_factory(url: str, deadline_s: float | None) -> tuple[Callable[[], RemoteOpenEnvEpisode], str]:
    """Fresh :class:`RemoteOpenEnvEpisode` objects of the server at ``url``, and the environment's name (the
    server's ``/metadata`` name, else ``openenv-remote``), after the start-up checks of the module docstring."""
    base, ws_url = _urls(url)
    shown = f"producer.environment '{PREFIX}{safe_url(url)}'"
    try:
        import websockets.sync.client  # noqa: F401  (openenv-core's dependency)
    except ImportError:
        raise EnvironmentLoadError(f"{shown} needs the websockets package: pip install 'stream-rl[envs]'") from None
    health = _get(base + "/health", shown)
    if health.status != 200:
        raise EnvironmentLoadError(f"{shown}: /health answered HTTP {health.status}, not 200")
    field = _action_field(_get_json(base + "/schema", shown), shown)
    name = _server_name(base)
    timeout_s = deadline_s if deadline_s is not None else 60.0
    return (lambda: RemoteOpenEnvEpisode(ws_url, field, name, timeout_s)), name


class RemoteOpenEnvEpisode:
    """One session of an OpenEnv server for one rollout (module docstring)."""

    def __init__(self, ws_url: str, field: str, name: str, timeout_s: float) -> None:
        self.ws_url, self.field, self.name, self.timeout_s = ws_url, field, name, timeout_s
        self.socket: Any = None

    def reset(self, prompt: Prompt) -> None:
        from websockets.sync.client import connect

        self.socket = connect(self.ws_url, open_timeout=min(self.timeout_s, START_TIMEOUT_S), close_timeout=2,
                              max_size=MAX_MESSAGE_BYTES)
        episode = f"{prompt.prompt_id}/{prompt.epoch}"
        self._ask({"type": "reset", "data": {"seed": episode_seed(episode), "episode_id": episode}})

    def step(self, policy_text: str) -> Observation:
        data = self._ask({"type": "step", "data": {self.field: policy_text}})
        reward = data.get("reward")
        if isinstance(reward, bool):
            reward = float(reward)
        observation = data.get("observation")
        if not isinstance(observation, dict):
            raise RemoteEnvironmentError(f"OpenEnv server {self.name} answered an observation that is not an object")
        values = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
        return Observation(observation_text(values), done=bool(data.get("done", False)), reward=reward,
                           tags={"env": self.name})  # a reward that is not a finite number: ValueError, as in-process

    def close(self) -> None:
        """End the session: a ``close`` message, then the socket (best effort: the play is over either way)."""
        socket, self.socket = self.socket, None
        if socket is None:
            return
        try:  # the server ends the session on "close" and closes the socket itself: wait for that (bounded)
            socket.send(json.dumps({"type": "close"}))
            socket.recv(timeout=CLOSE_WAIT_S)
        except Exception:  # closed as asked, a dead server, or a server that goes on talking: close our side
            pass
        try:
            socket.close()
        except Exception:
            pass

    def _ask(self, message: dict) -> dict:
        """Send one message; the answer's ``data`` if it is an observation, else :class:`RemoteEnvironmentError`."""
        if self.socket is None:
            raise RemoteEnvironmentError(f"OpenEnv server {self.name}: step before reset")
        from websockets.exceptions import ConnectionClosed

        try:
            self.socket.send(json.dumps(message))
        except ConnectionClosed:  # closed by the server: what it said before closing (a refusal) is read below
            pass
        try:
            raw = self.socket.recv(timeout=self.timeout_s)
        except TimeoutError:  # no answer within the episode's deadline: the same error whichever clock fires first
            raise EnvironmentTimeout(f"environment {self.name} {message['type']} timed out after {self.timeout_s:g} s "
                                     f"(producer.env_timeout_s)") from None
        except ConnectionClosed as exc:
            raise RemoteEnvironmentError(f"OpenEnv server {self.name} closed the session at {message['type']}: "
                                         f"{exc}") from None
        try:
            answer = loads_json(raw)
        except (ValueError, TypeError):
            raise RemoteEnvironmentError(f"OpenEnv server {self.name} answered {message['type']} with something "
                                         f"that is not JSON: {str(raw)[:80]!r}") from None
        kind = answer.get("type") if isinstance(answer, dict) else None
        data = answer.get("data") if isinstance(answer, dict) else None
        if kind == "error":
            detail = data.get("message", "") if isinstance(data, dict) else data
            raise RemoteEnvironmentError(f"OpenEnv server {self.name} refused {message['type']}: "
                                         f"{str(detail)[:_REASON_CHARS]}")
        if kind != "observation" or not isinstance(data, dict):
            raise RemoteEnvironmentError(f"OpenEnv server {self.name} answered {message['type']} with "
                                         f"{str(kind)[:40]!r}, not an observation")
        return data


def _urls(url: str) -> tuple[str, str]:
    """(the server's http(s) base URL, its ``/ws`` session URL)."""
    parts = urllib.parse.urlsplit(url)
    http = {"http": "http", "ws": "http", "https": "https", "wss": "https"}.get(parts.scheme)
    if http is None or not parts.hostname:
        raise EnvironmentLoadError(f"producer.environment '{PREFIX}{safe_url(url)}': the server's URL must be "
                                   f"http(s)://HOST:PORT or ws(s)://HOST:PORT")
    path = parts.path.rstrip("/")
    base = urllib.parse.urlunsplit((http, parts.netloc, path, "", ""))
    return base, urllib.parse.urlunsplit(({"http": "ws", "https": "wss"}[http], parts.netloc, path + "/ws", "", ""))


def _get(url: str, shown: str) -> Any:
    try:
        return exchange(url, timeout_s=START_TIMEOUT_S, what=f"OpenEnv server {safe_url(url)}", max_bytes=1 << 20)
    except HttpRewardError as exc:
        raise EnvironmentLoadError(f"{shown}: the server is not reachable: {exc}") from None


def _get_json(url: str, shown: str) -> Any:
    answer = _get(url, shown)
    if answer.status != 200:
        raise EnvironmentLoadError(f"{shown}: /{url.rsplit('/', 1)[-1]} answered HTTP {answer.status}, not 200")
    try:
        return loads_json(answer.body)
    except ValueError as exc:
        raise EnvironmentLoadError(f"{shown}: /{url.rsplit('/', 1)[-1]} is not JSON: {exc}") from None


def _action_field(schema: Any, shown: str) -> str:
    """The first string property of the action's JSON schema (``metadata`` aside)."""
    action = schema.get("action") if isinstance(schema, dict) else None
    properties = action.get("properties") if isinstance(action, dict) else None
    if not isinstance(properties, dict):
        raise EnvironmentLoadError(f"{shown}: /schema names no action (an OpenEnv server's /schema has "
                                   f"'action.properties')")
    for name, spec in properties.items():
        if name != "metadata" and isinstance(spec, dict) and spec.get("type") == "string":
            return name
    raise EnvironmentLoadError(f"{shown}: the action has no string field to carry the policy's text (fields: "
                               f"{', '.join(map(str, properties))[:_REASON_CHARS]})")


def _server_name(base: str) -> str:
    """The server's ``/metadata`` name, reduced to ``[A-Za-z0-9_.-]`` (a metric key), else ``openenv-remote``."""
    try:
        answer = exchange(base + "/metadata", timeout_s=START_TIMEOUT_S, what="OpenEnv server", max_bytes=1 << 20)
        name = loads_json(answer.body).get("name") if answer.status == 200 else None
    except (HttpRewardError, ValueError, AttributeError):
        name = None
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "", name)[:64] if isinstance(name, str) else ""
    return cleaned or "openenv-remote"
