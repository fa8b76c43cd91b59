"""Rewards from an HTTP reward server: the JSON batch protocol and its client (standard library only).

Consumes: ``scorer.reward_url`` (``http://`` or ``https://``, TLS certificates verified), header values from the
environment (``scorer.reward_headers_env``: header name -> environment variable name) and batches of rollouts.
Produces: :class:`HttpRewardClient`, a batch reward function (:func:`stream_rl.rewards.calls.batched`) that
:class:`stream_rl.rewards.calls.RewardCaller` runs with its deadline, concurrency and retries; and
:func:`check_reachable` for start-up.

The protocol (one POST per batch, ``Content-Type: application/json``; OpenRLHF's ``/get_reward`` request shape
plus explicit fields)::

    request  {"query":     [prompt + response, ...],      # what OpenRLHF's remote reward model reads
              "prompts":   [prompt, ...],
              "responses": [response, ...],
              "labels":    [answer or null, ...],
              "metadata":  [{str: str}, ...]}
    answer   {"rewards":       [float | null, ...],          # one per rollout, in order
              "token_rewards": [[float, ...] | null, ...],   # optional, one list per rollout
              "errors":        [str | null, ...]}            # optional: why a reward is null

    GET /health -> 200 {"status": "ok", ...}

Guarantees:
- A transport failure (connection refused or reset, a socket timeout) and HTTP 429/502/503/504 and other 5xx
  raise :class:`HttpRewardError` with ``retriable = True`` (the caller retries, bounded); any other HTTP error,
  a body that is not JSON (an HTML error page), a JSON body without a ``rewards`` list or with the wrong number
  of rewards raises it with ``retriable = False``. Every reason names the URL (without its query string), never a
  header value.
- A null reward becomes that rollout's failure with the server's ``errors[i]`` as reason; non-numeric or
  non-finite values are passed on and refused by the contract's check with a reason.
- A header whose environment variable is unset is refused when the client is built, naming the variable.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

RETRIABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
"""HTTP statuses worth another try: timeouts, rate limits and server-side failures."""
_SNIPPET = 80


class HttpRewardError(RuntimeError):
    """A reward server call failed; ``retriable`` says whether trying again may help; ``str()`` is the reason."""

    def __init__(self, reason: str, *, retriable: bool) -> None:
        super().__init__(reason)
        self.retriable = retriable


def headers_from_env(headers_env: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{header: os.environ[var]}`` for ``headers_env = {header: var}``; ValueError naming a missing variable."""
    environ = os.environ if environ is None else environ
    missing = sorted(var for var in headers_env.values() if var not in environ)
    if missing:
        raise ValueError(f"scorer.reward_headers_env: environment variable(s) {missing} not set")
    return {header: environ[var] for header, var in headers_env.items()}


def safe_url(url: str) -> str:
    """``url`` without credentials, query or fragment (what reasons and logs may show)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def encode_request(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
                   metadatas: Sequence[Mapping[str, str]]) -> bytes:
    """The protocol's request body for one batch."""
    body = {"query": [p + r for p, r in zip(prompts, responses)], "prompts": list(prompts),
            "responses": list(responses), "labels": list(answers), "metadata": [dict(m) for m in metadatas]}
    return json.dumps(body).encode()


def decode_answer(raw: bytes, content_type: str, expected: int, where: str) -> list[Any]:
    """One value per rollout from the server's answer: a float-like, a ``{"reward", "token_rewards"}`` dict, or an
    Exception (that rollout's failure); HttpRewardError (not retriable) when the answer as a whole is unusable."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        snippet = raw[:_SNIPPET].decode("utf-8", "replace").replace("\n", " ")
        raise HttpRewardError(f"reward server {where} answered {content_type or 'no content type'}, not JSON: "
                              f"{snippet!r}", retriable=False) from None
    rewards = body.get("rewards") if isinstance(body, dict) else None
    if not isinstance(rewards, list):
        raise HttpRewardError(f"reward server {where} answered JSON without a 'rewards' list", retriable=False)
    if len(rewards) != expected:
        raise HttpRewardError(f"reward server {where} answered {len(rewards)} rewards for {expected} rollouts",
                              retriable=False)
    tokens = _per_rollout(body, "token_rewards", expected, where)
    errors = _per_rollout(body, "errors", expected, where)
    out: list[Any] = []
    for reward, token_rewards, error in zip(rewards, tokens, errors):
        if reward is None:
            out.append(HttpRewardError(f"reward server {where}: {error or 'no reward and no reason'}",
                                       retriable=False))
        elif token_rewards is not None:
            out.append({"reward": reward, "token_rewards": token_rewards})
        else:
            out.append(reward)
    return out


def _per_rollout(body: dict, key: str, expected: int, where: str) -> list[Any]:
    values = body.get(key)
    if values is None:
        return [None] * expected
    if not isinstance(values, list) or len(values) != expected:
        raise HttpRewardError(f"reward server {where} answered {key!r} that is not a list of {expected}",
                              retriable=False)
    return values


class HttpRewardClient:
    """A batch reward function that POSTs to a reward server (the protocol of the module docstring)."""

    batched = True

    def __init__(self, url: str, *, timeout_s: float = 30.0, headers_env: Mapping[str, str] | None = None,
                 environ: Mapping[str, str] | None = None, tls_context: ssl.SSLContext | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"scorer.reward_url {url!r} must be an http:// or https:// URL")
        self.url, self.where, self.timeout_s = url, safe_url(url), timeout_s
        self._headers = {"Content-Type": "application/json", "Accept": "application/json",
                         **headers_from_env(headers_env or {}, environ)}
        self._tls = tls_context or ssl.create_default_context()  # verifies certificates and host names
        self.__qualname__ = f"reward server {self.where}"

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
                 metadatas: Sequence[Mapping[str, str]]) -> list[Any]:
        data = encode_request(prompts, responses, answers, metadatas)
        request = urllib.request.Request(self.url, data=data, headers=self._headers, method="POST")
        raw, content_type = self._send(request)
        return decode_answer(raw, content_type, len(prompts), self.where)

    def _send(self, request: urllib.request.Request) -> tuple[bytes, str]:
        return send(request, self.timeout_s, self._tls, f"reward server {self.where}")


def send(request: urllib.request.Request, timeout_s: float, tls: ssl.SSLContext, what: str) -> tuple[bytes, str]:
    """The body and content type of ``request``'s answer; HttpRewardError (retriable or not, see the module
    docstring) whose reason starts with ``what`` (e.g. ``reward server <url>``)."""
    context = tls if request.full_url.startswith("https://") else None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as answer:
            return answer.read(), answer.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        snippet = exc.read()[:_SNIPPET].decode("utf-8", "replace").replace("\n", " ")
        raise HttpRewardError(f"{what} answered HTTP {exc.code}: {snippet!r}",
                              retriable=exc.code in RETRIABLE_STATUS) from None
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, DNS, socket timeout
        raise HttpRewardError(f"{what} unreachable: {getattr(exc, 'reason', exc)}", retriable=True) from None


def check_reachable(url: str, timeout_s: float = 5.0, tls_context: ssl.SSLContext | None = None) -> None:
    """GET ``/health`` next to ``url``; ValueError in one line naming ``scorer.reward_url`` when no server answers."""
    parts = urllib.parse.urlsplit(url)
    health = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))
    context = (tls_context or ssl.create_default_context()) if parts.scheme == "https" else None
    try:
        with urllib.request.urlopen(health, timeout=timeout_s, context=context) as answer:
            answer.read()
    except urllib.error.HTTPError as exc:
        raise ValueError(f"scorer.reward_url {safe_url(url)}: GET /health answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"scorer.reward_url {safe_url(url)} is unreachable: "
                         f"{getattr(exc, 'reason', exc)}") from None
