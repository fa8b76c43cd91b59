"""Cutting a generation (``producer.oversample`` / ``abort_after_s``) on servers that take the abort badly: one that
ignores it, one whose abort endpoint is missing, one that misses the first abort of each request, one that answers
an aborted request with garbage, one that aborts a request before a sample drew a token. Each is played by a stdlib
HTTP server (support.vllm_servers.BrokenServer) answering as vLLM 0.32 does where it behaves; the real abort is
tested on ``vllm serve`` in tests/integration/test_server_engine.py. The engine must never hang or raise for a bad
abort, must return each group once (ended whole, or cut and empty), hand over only prefixes whose every sample
drew a token, and mark down a server only for a broken answer. No vLLM needed: these run everywhere.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from support.vllm_servers import BrokenServer

from producers.config import ServerSettings
from producers.engines.base import Sampling

FAST = 5  # the last prompt token of the one request that answers at once: its group ends and the cut comes
PROMPTS = [[1, FAST], [1, 6], [1, 7], [1, 8]]


def _choice(j: int, tokens: list[int], finish: str) -> dict:
    return {"index": j, "token_ids": tokens, "finish_reason": finish,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in tokens]},
            "weight_versions": [{"version": "0", "start": 0, "end": len(tokens)}] if tokens else []}


class Fleet:
    """A server's requests: the probe answers at once; the ``FAST`` request answers whole once every request of the
    call has arrived (so the cut finds them all on the server, however loaded the machine); every other request
    waits for its abort (``misses``: aborts of each request ignored first), then answers as ``mode`` says."""

    def __init__(self, mode: str, misses: int = 0):
        self.mode, self.misses = mode, misses
        self.aborts: Counter[str] = Counter()
        self.aborted: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self.arrived: set[int] = set()
        self.all_arrived = threading.Event()

    def _event(self, request_id: str) -> threading.Event:
        with self.lock:
            return self.aborted.setdefault(request_id, threading.Event())

    def generate(self, body: dict) -> tuple[int, dict]:
        n = body["sampling_params"].get("n", 1)
        whole = {"choices": [_choice(j, [3 + j, 4], "length") for j in range(n)]}
        if body["sampling_params"].get("max_tokens") == 1:
            return 200, whole
        with self.lock:
            self.arrived.add(body["token_ids"][-1])
            if len(self.arrived) == len(PROMPTS):
                self.all_arrived.set()
        if body["token_ids"][-1] == FAST:
            self.all_arrived.wait(10)
            return 200, whole
        if self.mode in ("ignore", "missing"):  # it runs to its end (0.3 s) whatever the abort says
            time.sleep(0.3)
            return 200, whole
        if not self._event(body["request_id"]).wait(10):
            return 200, whole
        if self.mode == "garbage":
            return 200, {"choices": "not a list"}
        first = [] if self.mode == "unscheduled" else [3]
        return 200, {"choices": [_choice(0, first, "abort")] + [_choice(j, [3 + j], "abort") for j in range(1, n)]}

    def abort(self, body: dict) -> tuple[int, dict]:
        if self.mode == "missing":
            return 404, {"detail": "Not Found"}
        for name in body["request_ids"]:
            request_id = name.removeprefix("generate-tokens-")
            self.aborts[request_id] += 1
            if self.aborts[request_id] > self.misses:
                self._event(request_id).set()
        return 200, {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from support.producers import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("cut-hostile") / "policy")


def _cut(model_dir, tmp_path, fleet: Fleet):
    """One generation of ``PROMPTS`` (2 samples each) cut once a group has ended: (groups, what on_cut got, the
    engine's fleet snapshot, seconds)."""
    from producers.engines.server import ServerEngine

    server = BrokenServer(model_dir, fleet.generate, abort=fleet.abort)
    engine = ServerEngine(model_dir, ServerSettings(urls=[server.url], weights_dir=tmp_path / "w",
                                                    request_timeout_s=5.0, discover_every_s=60))
    cuts: dict[int, tuple] = {}
    try:
        started = time.perf_counter()
        groups = engine.generate(PROMPTS, 2, Sampling(1.0), 4, seed=0, stop_when=any,
                                 on_cut=lambda b, samples, running: cuts.setdefault(b, (samples, running)))
        return groups, cuts, engine.fleet()[0], time.perf_counter() - started
    finally:
        engine.close()
        server.close()


@pytest.mark.parametrize("misses", [0, 2])
def test_an_aborted_request_hands_over_its_prefixes_and_a_missed_abort_is_sent_again(model_dir, tmp_path, misses):
    fleet = Fleet("honour", misses=misses)
    groups, cuts, server, _ = _cut(model_dir, tmp_path, fleet)
    assert [len(g) for g in groups] == [2, 0, 0, 0]  # the ended group whole, the cut ones empty
    assert sorted(cuts) == [1, 2, 3]
    for samples, running in cuts.values():
        assert running == [True, True]
        assert [(s.token_ids, s.logprobs, s.token_versions, s.finish_reason) for s in samples] == [
            ([3], [-0.5], [0], "length"), ([4], [-0.5], [0], "length")]
    assert min(fleet.aborts.values()) == misses + 1  # each request was aborted until its abort took
    assert server["healthy"] and server["outstanding"] == 0


def test_a_cut_group_with_a_sample_that_drew_no_token_is_not_handed_over(model_dir, tmp_path):
    groups, cuts, server, _ = _cut(model_dir, tmp_path, Fleet("unscheduled"))
    assert [len(g) for g in groups] == [2, 0, 0, 0] and cuts == {}  # re-queued whole by the producer
    assert server["healthy"]


@pytest.mark.parametrize("mode", ["ignore", "missing"])
def test_a_server_that_ignores_the_abort_or_lacks_its_endpoint_runs_the_requests_to_their_end(model_dir, tmp_path,
                                                                                               mode):
    groups, cuts, server, _ = _cut(model_dir, tmp_path, Fleet(mode))
    assert [[s.token_ids for s in g] for g in groups] == [[[3, 4], [4, 4]]] * 4  # every group ended, whole
    assert cuts == {} and server["healthy"] and server["outstanding"] == 0


def test_garbage_in_answer_to_an_abort_marks_the_server_down_and_loses_no_group(model_dir, tmp_path):
    groups, cuts, server, _ = _cut(model_dir, tmp_path, Fleet("garbage"))
    assert [len(g) for g in groups] == [2, 0, 0, 0] and cuts == {}  # the cut groups re-queued whole, not re-issued
    assert not server["healthy"] and "without indexed choices" in server["last_error"]
