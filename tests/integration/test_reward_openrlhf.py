"""OpenRLHF both ways, on real processes and loopback servers.

The scorer against a server shaped like OpenRLHF's ``serve_rm.py`` (POST /get_reward only, no /health, answering
``{"rewards", "scores", "extra_logs"}``): it starts, says that health is not checked, and scores. ``stream-rl
reward-server`` against the requests OpenRLHF's current and previous remote-reward clients send (query only, a
decoded BOS before the prompt, integer labels, ``queries``): every answer is one OpenRLHF can read (``rewards``
through ``torch.tensor``, never a null), a failed rollout's reason in ``errors``."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch
from support.hostile_http import Scripted, reply, serving
from support.messages import rollout_for_scoring

from consumers.scorer.config import ScorerConfig
from consumers.scorer.scoring import load_scoring, score_rollouts
from stream_rl.rewards.contract import RewardFnError
from stream_rl.rewards.server import RewardServer


def serve_rm(handler, n):
    """What OpenRLHF's serve_rm.py (FastAPI) answers: POST /get_reward scores each query; other paths 404; a GET
    on the POST route 405."""
    if handler.command == "POST" and handler.path == "/get_reward":
        rewards = [float(len(q)) for q in json.loads(handler.server.seen[n - 1]["body"])["query"]]
        reply(handler, 200, {"rewards": rewards, "scores": rewards, "extra_logs": {"dummy_scores": rewards}})
    elif handler.path == "/get_reward":
        reply(handler, 405, {"detail": "Method Not Allowed"})
    else:
        reply(handler, 404, {"detail": "Not Found"})


def test_the_scorer_uses_a_serve_rm_server_without_health(caplog):
    server = Scripted(serve_rm)
    with serving(server) as url, caplog.at_level(logging.WARNING, logger="consumers.scorer.services"):
        scoring = load_scoring(ScorerConfig(reward_fn=None, reward_url=url + "get_reward"), "scorer-t")
        try:
            out = score_rollouts([rollout_for_scoring(0, 0, response_text="7"),
                                  rollout_for_scoring(0, 1, response_text="88")], scoring)
        finally:
            scoring.services.close()
    prompt = rollout_for_scoring(0, 0).prompt_text
    assert [o.reward for o in out] == [float(len(prompt) + 1), float(len(prompt) + 2)]  # len(prompt + response)
    assert [(s["method"], s["path"]) for s in server.seen[:2]] == [("GET", "/health"), ("GET", "/get_reward")]
    assert caplog.messages == [f"scorer.reward_url {url}get_reward: no GET /health (HTTP 404); GET /get_reward "
                               "answered 405: the server is up, its health is not checked"]


def test_a_server_at_neither_health_nor_the_reward_path_is_refused_at_start():
    server = Scripted(serve_rm)
    with serving(server) as url, pytest.raises(RewardFnError) as info:
        load_scoring(ScorerConfig(reward_fn=None, reward_url=url + "reward"), "scorer-t")
    assert str(info.value) == (f"scorer.reward_url {url}reward: GET /health and GET /reward both answered HTTP 404: "
                               "no reward server at that path")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def _as_openrlhf_reads(answer: dict) -> list[float]:
    """What OpenRLHF's clients do with an answer: ``torch.tensor`` of the rewards and of each extra log."""
    for values in answer.get("extra_logs", {}).values():
        torch.as_tensor(values)
    return torch.tensor(answer["rewards"]).tolist()


def test_the_command_serves_what_openrlhf_clients_send():
    proc = subprocess.Popen([sys.executable, "-m", "stream_rl.cli.main", "reward-server", "gsm8k"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        assert lines and lines[0], "no URL line"
        url = lines[0].strip().rsplit(" ", 1)[1] + "get_reward"
        current = _post(url, {"query": ["<s>Q: 2+2? A: so #### 4</s>"], "prompts": ["Q: 2+2? A:"], "labels": [4]})
        batch = _post(url, {"query": ["<|begin_of_text|>Q: 1+1? A: #### 2", "Q: 3+3? A: #### 7", "Q: 5? A: #### 5"],
                            "prompts": ["Q: 1+1? A:", "Q: 3+3? A:", "Q: 5? A:"], "labels": ["2", "6", None]})
        query_only = _post(url, {"query": ["Q: 1+1? A: #### 2"]})
        older = _post(url, {"queries": ["Q: 9? A: #### 9"], "prompts": ["Q: 9? A:"], "references": ["9"]})
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    assert _as_openrlhf_reads(current) == [1.0]
    assert current["extra_logs"] == {"reward_failed": [0.0]} and "errors" not in current
    assert _as_openrlhf_reads(batch) == [1.0, 0.0, 0.0]  # the third failed: the documented fallback 0.0
    assert batch["extra_logs"] == {"reward_failed": [0.0, 0.0, 1.0]}
    assert batch["errors"][:2] == [None, None] and batch["errors"][2].startswith("gsm8k raised ValueError: ")
    assert _as_openrlhf_reads(query_only) == [0.0] and query_only["extra_logs"] == {"reward_failed": [1.0]}
    assert _as_openrlhf_reads(older) == [1.0]


def test_openrlhf_queries_are_split_at_their_prompt_and_a_query_without_it_fails_alone():
    seen: list[tuple] = []

    def score(prompts, responses, answers, metadatas):
        seen.append((prompts, responses, answers))
        return [float(len(r)) for r in responses]

    server = RewardServer(score, name="len", openrlhf_fallback=-1.0)
    with serving(server) as url:
        split = _post(url + "get_reward", {"query": ["<s>ab<s>abXYZ", "nothing here", "plain"],
                                           "prompts": ["ab", "Q:", ""], "labels": [{"k": 1}, 7.5, True]})
        whole = _post(url, {"query": ["<s>Q: 1 A: 1"]})
    assert split["rewards"] == [8.0, -1.0, 5.0]  # after the FIRST "ab": "<s>abXYZ"; the second: the fallback
    assert split["errors"] == [None, "the query does not contain its prompt, so its response cannot be told "
                                     "apart", None]
    assert seen[0] == (["ab", ""], ["<s>abXYZ", "plain"], ['{"k": 1}', "true"])
    assert whole["rewards"] == [12.0] and seen[1][:2] == ([""], ["<s>Q: 1 A: 1"])  # query only: all of it


def test_our_own_protocol_stays_strict():
    server = RewardServer(lambda p, r, a, m: [1.0] * len(p), name="one")
    with serving(server) as url, pytest.raises(urllib.error.HTTPError) as info:
        _post(url, {"prompts": ["p"], "responses": ["r"], "labels": [7]})
    assert info.value.code == 400
    assert json.loads(info.value.read()) == {"error": "bad request: 'labels' must hold strings or nulls"}
