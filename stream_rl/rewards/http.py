"""Rewards from an HTTP reward server: the JSON batch protocol, its client, and the transport that the client, the
LLM judge (:mod:`stream_rl.rewards.judge`) and the start-up probe share (standard library only).

Consumes: ``scorer.reward_url`` (``http://`` or ``https://``, TLS certificates verified), header values from the
environment (``scorer.reward_headers_env``: header name -> environment variable name) and batches of rollouts.
Produces: :class:`HttpRewardClient`, a batch reward function (:func:`stream_rl.rewards.calls.batched`) that
:class:`stream_rl.rewards.calls.RewardCaller` runs with its deadline, concurrency and retries;
:func:`check_reachable` for start-up; :func:`send` and :func:`exchange` (one guarded HTTP exchange).

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
                                                             # (other keys, e.g. OpenRLHF's "scores", ignored)
    GET /health -> 200 {"status": "ok", ...}   (optional: see check_reachable)

Guarantees of the transport (every exchange of the client, the judge and the start-up probe):
- Proxies come from the environment (``http_proxy``, ``https_proxy``, ``no_proxy``), as urllib reads them; https
  goes through a CONNECT tunnel, certificates verified end to end.
- One deadline (``timeout_s``) covers the whole exchange, connect, request, headers and body: a watchdog
  (:data:`stream_rl.runtime.http_serving.WATCHDOG`) shuts the socket down at the deadline, so a server trickling
  its answer cannot keep the reading thread alive past it.
- Answers are capped at ``max_answer_bytes`` (:data:`MAX_ANSWER_BYTES`, 16 MiB): a declared length over the cap is
  refused before reading; an undeclared one is cut at the cap (not retriable).
- Redirects: 301/302/307/308 to the same origin (scheme, host and port) are followed, at most
  :data:`MAX_REDIRECTS`, re-sending the same method, body and headers. A redirect to another origin is refused
  (not retriable), naming its target: credentials (``reward_headers_env``, the judge's API key) are never sent
  to an origin other than the configured one, and no other host's answer becomes a reward. Other 3xx are
  HTTP errors.
- A transport failure (refused, reset, a connection closed mid-answer, the deadline) and HTTP 408/425/429/5xx
  raise :class:`HttpRewardError` with ``retriable = True`` (the caller retries, bounded); any other HTTP error,
  a body that is not JSON (an HTML error page) or nested too deeply, a JSON body without a ``rewards`` list or
  with the wrong number of rewards, an answer over the cap, a refused redirect or a certificate that does not
  verify raises it with ``retriable = False``. Every reason names the URL (without its query string), never a
  header value.
- A null reward becomes that rollout's failure with the server's ``errors[i]`` as reason; non-numeric or
  non-finite values are passed on and refused by the contract's check with a reason.
- A header whose environment variable is unset is refused when the client is built, naming the variable.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stream_rl.runtime.http_serving import WATCHDOG

RETRIABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
"""HTTP statuses worth another try: timeouts, rate limits and server-side failures."""
MAX_ANSWER_BYTES = 16 * 1024 * 1024
"""Default cap on an answer's body: far above a batch of rewards, far below what would strain the scorer."""
MAX_REDIRECTS = 3
FOLLOWED_REDIRECTS = frozenset({301, 302, 307, 308})
_SNIPPET = 80
_CHUNK = 64 * 1024


class HttpRewardError(RuntimeError):
    """A reward server call failed; ``retriable`` says whether trying again may help; ``str()`` is the reason and
    ``detail`` the part after the URL (what went wrong)."""

    def __init__(self, reason: str, *, retriable: bool, detail: str | None = None) -> None:
        super().__init__(reason)
        self.retriable = retriable
        self.detail = detail or reason


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
    host = f"[{host}]" if ":" in host else host
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def origin(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of ``url``, the port made explicit: two URLs may share credentials only when equal."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or (443 if scheme == "https" else 80)


def loads_json(raw: bytes) -> Any:
    """``json.loads`` that refuses, with ValueError, text nested deeper than the interpreter can parse."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def encode_request(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
                   metadatas: Sequence[Mapping[str, str]]) -> bytes:
    """The protocol's request body for one batch."""
    body = {"query": [p + r for p, r in zip(prompts, responses)], "prompts": list(prompts),
            "responses": list(responses), "labels": list(answers), "metadata": [dict(m) for m in metadatas]}
    return json.dumps(body).encode()


def decode_answer(raw: bytes, content_type: str, expected: int, where: str) -> list[Any]:
    """One value per rollout from the server's answer: a float-like, a ``{"reward", "token_rewards"}`` dict, or an
    Exception (that rollout's failure); HttpRewardError (not retriable) when the answer as a whole is unusable."""
    snippet = raw[:_SNIPPET].decode("utf-8", "replace").replace("\n", " ")
    try:
        body = loads_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HttpRewardError(f"reward server {where} answered {content_type or 'no content type'}, not JSON: "
                              f"{snippet!r}", retriable=False) from None
    except ValueError as exc:  # nested too deeply
        raise HttpRewardError(f"reward server {where} answered {exc}: {snippet!r}", retriable=False) from None
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
                 environ: Mapping[str, str] | None = None, tls_context: ssl.SSLContext | None = None,
                 max_answer_bytes: int = MAX_ANSWER_BYTES) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"scorer.reward_url {url!r} must be an http:// or https:// URL")
        self.url, self.where, self.timeout_s = url, safe_url(url), timeout_s
        self.max_answer_bytes = max_answer_bytes
        self._headers = {"Content-Type": "application/json", "Accept": "application/json",
                         **headers_from_env(headers_env or {}, environ)}
        self._tls = tls_context or ssl.create_default_context()  # verifies certificates and host names
        self.__qualname__ = f"reward server {self.where}"

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None],
                 metadatas: Sequence[Mapping[str, str]]) -> list[Any]:
        data = encode_request(prompts, responses, answers, metadatas)
        answer = send(self.url, data, self._headers, timeout_s=self.timeout_s, tls=self._tls,
                      what=f"reward server {self.where}", max_bytes=self.max_answer_bytes)
        return decode_answer(answer.body, answer.content_type, len(prompts), self.where)


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: its status, content type and (capped) body."""

    status: int
    content_type: str
    body: bytes


def send(url: str, body: bytes, headers: Mapping[str, str], *, timeout_s: float, tls: ssl.SSLContext, what: str,
         max_bytes: int = MAX_ANSWER_BYTES) -> Answer:
    """POST ``body`` to ``url``; the 2xx answer, or HttpRewardError (retriable or not, see the module docstring)
    whose reason starts with ``what`` (e.g. ``reward server <url>``)."""
    answer = exchange(url, "POST", body, headers, timeout_s=timeout_s, tls=tls, what=what, max_bytes=max_bytes)
    if not 200 <= answer.status < 300:
        snippet = answer.body[:_SNIPPET].decode("utf-8", "replace").replace("\n", " ")
        raise HttpRewardError(f"{what} answered HTTP {answer.status}: {snippet!r}",
                              retriable=answer.status in RETRIABLE_STATUS)
    return answer


def exchange(url: str, method: str = "GET", body: bytes | None = None, headers: Mapping[str, str] | None = None,
             *, timeout_s: float, tls: ssl.SSLContext | None = None, what: str,
             max_bytes: int = MAX_ANSWER_BYTES) -> Answer:
    """One request and its answer, whatever its status, under one deadline, following same-origin redirects only;
    HttpRewardError for a transport failure, an answer over ``max_bytes`` or a redirect to another origin."""
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        answer, location = _round_trip(url, method, body, dict(headers or {}), tls, deadline, max_bytes, what)
        if answer.status not in FOLLOWED_REDIRECTS or not location:
            return answer
        target = urllib.parse.urljoin(url, location)
        if origin(target) != origin(url):
            detail = (f"redirected (HTTP {answer.status}) to another origin, {safe_url(target)}: refused "
                      f"(credentials are never sent to another origin)")
            raise HttpRewardError(f"{what} {detail}", retriable=False, detail=detail)
        url = target
    detail = f"redirected more than {MAX_REDIRECTS} times"
    raise HttpRewardError(f"{what} {detail}", retriable=False, detail=detail)


def _round_trip(url: str, method: str, body: bytes | None, headers: dict[str, str], tls: ssl.SSLContext | None,
                deadline: float, max_bytes: int, what: str) -> tuple[Answer, str | None]:
    parts = urllib.parse.urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    timeout_s = deadline - time.monotonic()
    proxy = _proxy(parts)  # the environment's http_proxy / https_proxy and no_proxy, as urllib reads them
    host, port = (proxy.hostname, proxy.port or 80) if proxy else (parts.hostname, parts.port)
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=timeout_s, context=tls or ssl.create_default_context())
        if proxy:
            conn.set_tunnel(parts.hostname, parts.port or 443, headers=_proxy_auth(proxy))
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        if proxy:  # a forward proxy is asked for the absolute URL
            target = urllib.parse.urlunsplit(parts._replace(fragment=""))
            headers = {**headers, **_proxy_auth(proxy)}
    fired = threading.Event()
    try:
        if timeout_s <= 0:
            raise TimeoutError("no time left")
        conn.connect()
        with WATCHDOG.guard(conn.sock, deadline, fired):
            conn.request(method, target, body=body, headers=headers)
            response = conn.getresponse()
            data = _read_capped(response, max_bytes, what)
        if fired.is_set():  # cut by the watchdog: what was read is not the whole answer
            raise TimeoutError("deadline")
        return Answer(response.status, response.getheader("Content-Type", ""), data), response.getheader("Location")
    except HttpRewardError:
        raise
    except ssl.SSLCertVerificationError as exc:
        raise _failed(what, f"certificate not verified: {exc.verify_message}", retriable=False) from None
    except (http.client.HTTPException, OSError) as exc:
        if fired.is_set() or isinstance(exc, TimeoutError):
            raise _failed(what, "timed out: no complete answer within the call's deadline") from None
        if isinstance(exc, http.client.IncompleteRead | http.client.RemoteDisconnected):
            raise _failed(what, f"closed the connection mid-answer ({type(exc).__name__})") from None
        raise _failed(what, f"unreachable: {exc}", short=str(exc)) from None
    finally:
        conn.close()


def _proxy(parts: urllib.parse.SplitResult) -> urllib.parse.SplitResult | None:
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")


def _proxy_auth(proxy: urllib.parse.SplitResult) -> dict[str, str]:
    if proxy.username is None:
        return {}
    user = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
    return {"Proxy-Authorization": "Basic " + base64.b64encode(user.encode()).decode()}


def _failed(what: str, detail: str, *, retriable: bool = True, short: str | None = None) -> HttpRewardError:
    return HttpRewardError(f"{what} {detail}", retriable=retriable, detail=short or detail)


def _read_capped(response: http.client.HTTPResponse, max_bytes: int, what: str) -> bytes:
    declared = response.getheader("Content-Length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _failed(what, f"answered {int(declared)} bytes, over the cap of {max_bytes} bytes", retriable=False)
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read(_CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise _failed(what, f"answered more than the cap of {max_bytes} bytes", retriable=False)
        chunks.append(chunk)
    if response.length:  # a declared length not reached: the server closed the connection mid-answer
        raise http.client.IncompleteRead(b"".join(chunks), response.length)
    return b"".join(chunks)


def check_reachable(url: str, timeout_s: float = 5.0, tls_context: ssl.SSLContext | None = None
                    ) -> tuple[bool, str]:
    """Check at start-up that a reward server answers at ``url``: ``(health checked, a line saying how)``, or
    ValueError in one line naming ``scorer.reward_url``.

    ``GET /health`` answering 2xx: up. A server without ``/health`` (404, 405 or 501, as OpenRLHF's
    ``serve_rm.py``) is probed with ``GET <url>``: any answer but 404 means the reward path exists (a POST-only
    route answers 405), and the line says that health cannot be checked. ``/health`` answering anything else
    (503: a server whose scoring is stuck) is refused with its body."""
    where = f"scorer.reward_url {safe_url(url)}"
    parts = urllib.parse.urlsplit(url)
    health = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))
    tls = tls_context or ssl.create_default_context()
    try:
        answer = exchange(health, timeout_s=timeout_s, tls=tls, what=where, max_bytes=64 * 1024)
        if 200 <= answer.status < 300:
            return True, f"{where}: GET /health answered {answer.status}"
        if answer.status not in (404, 405, 501):
            snippet = answer.body[:200].decode("utf-8", "replace").replace("\n", " ")
            raise ValueError(f"{where}: GET /health answered HTTP {answer.status}: {snippet!r}")
        probe = exchange(url, timeout_s=timeout_s, tls=tls, what=where, max_bytes=64 * 1024)
    except HttpRewardError as exc:
        raise ValueError(f"{where} is unreachable: {exc.detail}") from None
    if probe.status == 404:
        raise ValueError(f"{where}: GET /health and GET {parts.path or '/'} both answered HTTP 404: no reward "
                         f"server at that path")
    return False, (f"{where}: no GET /health (HTTP {answer.status}); GET {parts.path or '/'} answered "
                   f"{probe.status}: the server is up, its health is not checked")
