"""The ``server`` engine against servers that misbehave after they passed the start-up check: one that stalls, one
that answers garbage, one that drops the connection, one that reports a version it was never given. Each is played
by a stdlib HTTP server (support.vllm_servers.BrokenServer); a healthy one answers beside it. The engine must
re-issue the lost requests on the healthy server (same seed), mark the bad one down with the reason, return every
group once, and refuse a version it does not hold. No vLLM needed: these run everywhere.
"""

from __future__ import annotations

import time

import pytest
from support.vllm_servers import BrokenServer

from producers.config import ServerSettings
from producers.engines.base import EngineError, Sampling


def _answer(body: dict, version: str = "0") -> tuple[int, dict]:
    """A well-formed answer: sample j of a request is [3 + j, 4] (eos of the demo tokenizer is not 4)."""
    n = body["sampling_params"].get("n", 1)
    choices = [{"index": j, "token_ids": [3 + j, 4], "finish_reason": "length",
                "logprobs": {"content": [{"token_id": 3 + j, "logprob": -0.5}, {"token_id": 4, "logprob": -0.25}]},
                "weight_versions": [{"version": version, "start": 0, "end": 2}]} for j in range(n)]
    return 200, {"choices": choices}


def _probe_or(behaviour):
    """Answer the engine's one-token start-up probe well, and every real request with ``behaviour``."""
    def generate(body: dict) -> tuple[int, dict]:
        if body["sampling_params"].get("max_tokens") == 1:
            return _answer(body)
        return behaviour(body)
    return generate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from support.producers import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("hostile") / "policy")


def _stall(body):
    time.sleep(3.0)
    return _answer(body)


def _garbage(body):
    return 200, {"choices": "not a list"}


def _server_error(body):
    return 503, {"error": {"message": "overloaded"}}


@pytest.mark.parametrize(("behaviour", "reason"), [(_stall, "timed out"), (_server_error, "HTTP 503: overloaded"),
                                                   (_garbage, "without indexed choices")])
def test_a_misbehaving_server_is_marked_down_and_its_requests_reissued(model_dir, tmp_path, behaviour, reason):
    from producers.engines.server import ServerEngine

    bad, good = BrokenServer(model_dir, _probe_or(behaviour)), BrokenServer(model_dir, _answer)
    engine = ServerEngine(model_dir, ServerSettings(urls=[bad.url, good.url], request_timeout_s=1.0,
                                                    weights_dir=tmp_path / "w", discover_every_s=60))
    try:
        groups = engine.generate([[1, 5], [1, 6], [1, 7], [1, 8]], 2, Sampling(1.0), 4, seed=0)
        assert [[s.token_ids for s in g] for g in groups] == [[[3, 4], [4, 4]]] * 4
        fleet = {s["url"]: s for s in engine.fleet()}
        assert not fleet[bad.url]["healthy"] and reason in fleet[bad.url]["last_error"]
        assert fleet[good.url]["requests"] == 4  # every group answered once, by the healthy server
    finally:
        engine.close()
        bad.close()
        good.close()


def test_a_server_reporting_a_version_it_was_not_given_is_refused(model_dir, tmp_path):
    from producers.engines.server import ServerEngine

    rogue = BrokenServer(model_dir, _probe_or(lambda body: _answer(body, version="5")))
    engine = ServerEngine(model_dir, ServerSettings(urls=[rogue.url], weights_dir=tmp_path / "w"))
    try:
        with pytest.raises(EngineError, match=r"version\(s\) \[5\] while this producer holds 0: is another producer"):
            engine.generate([[1, 5]], 1, Sampling(1.0), 4, seed=0)
    finally:
        engine.close()
        rogue.close()


def test_with_every_server_down_the_producer_stops_naming_each_and_why(model_dir, tmp_path):
    from producers.engines.server import ServerEngine

    bad = BrokenServer(model_dir, _probe_or(_server_error))
    engine = ServerEngine(model_dir, ServerSettings(urls=[bad.url], unavailable_s=0.5, weights_dir=tmp_path / "w",
                                                    discover_every_s=60))
    try:
        with pytest.raises(EngineError, match=rf"no inference server was usable for 0.5 s .*{bad.url}: .*503"):
            engine.generate([[1, 5]], 1, Sampling(1.0), 4, seed=0)
    finally:
        engine.close()
        bad.close()
