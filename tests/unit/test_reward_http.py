"""HTTP rewards (stream_rl.rewards.http, stream_rl.rewards.server, ``stream-rl reward-server``): real servers on
127.0.0.1 (ephemeral ports), in-process and as a subprocess; the client through RewardCaller's deadline and
retries; every bad answer (wrong count, non-finite, non-numeric, HTML, a 500 storm, a slow server) a reason."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stream_rl.rewards.calls import CallPolicy, RewardCaller, RewardRequest
from stream_rl.rewards.http import HttpRewardClient, check_reachable, headers_from_env, safe_url
from stream_rl.rewards.server import RewardServer, per_rollout_scorer
from stream_rl.rewards.verifiers import VERIFIERS

POLICY = CallPolicy(timeout_s=2.0, concurrency=4, max_retries=2, backoff_s=0.01, max_backoff_s=0.02)


def batch(answers: list[str | None], responses: list[str] | None = None) -> list[RewardRequest]:
    responses = responses or [f"so #### {a}" for a in answers]
    return [RewardRequest(f"q{i}", r, a, {"data_source": "gsm8k"}, response_length=3)
            for i, (r, a) in enumerate(zip(responses, answers))]


@contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}/"
    finally:
        server.shutdown()
        server.server_close()


class Canned(ThreadingHTTPServer):
    """A misbehaving reward server: ``reply(request_number, body) -> (status, content_type, bytes)``."""

    daemon_threads = True

    def __init__(self, reply: Callable[[int, dict], tuple[int, str, bytes]]) -> None:
        self.reply, self.count, self.headers_seen = reply, 0, []
        super().__init__(("127.0.0.1", 0), _CannedHandler)


class _CannedHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        return

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.count += 1
        self.server.headers_seen.append(dict(self.headers))
        status, content_type, data = self.server.reply(self.server.count, body)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def rewards_json(values: list) -> tuple[int, str, bytes]:
    return 200, "application/json", json.dumps({"rewards": values}).encode()


def call(url: str, requests: list[RewardRequest], policy: CallPolicy = POLICY, **client_kw):
    client_kw.setdefault("timeout_s", policy.timeout_s)
    with RewardCaller(HttpRewardClient(url, **client_kw), policy) as caller:
        return caller.call(requests)


def test_served_verifier_round_trip_in_one_batch():
    server = RewardServer(per_rollout_scorer(VERIFIERS["gsm8k"].reward, "gsm8k"), name="gsm8k", batch_size=2)
    with serving(server) as url:
        outcomes = call(url, batch(["72", "5", "1,234"], ["#### 72", "#### 6", "so 1234"]))
    assert [o.output.reward for o in outcomes] == [1.0, 0.0, 1.0]
    assert {o.attempts for o in outcomes} == {1}


def test_server_reports_a_rollouts_own_failure_and_the_rest_are_scored():
    server = RewardServer(per_rollout_scorer(VERIFIERS["gsm8k"].reward, "gsm8k"), name="gsm8k")
    with serving(server) as url:
        ok, missing = call(url, batch(["72", None], ["#### 72", "#### 1"]))
    assert ok.output.reward == 1.0
    assert not missing.ok and missing.reason.startswith(f"reward server {url}: gsm8k raised ValueError: ")


def test_openrlhf_request_shape_without_responses():
    seen: list[dict] = []

    def score(prompts, responses, answers, metadatas):
        seen.append({"responses": responses, "answers": answers})
        return [float(len(r)) for r in responses]

    server = RewardServer(score, name="len")
    with serving(server) as url:
        request = {"query": ["Q: 1+1? A: 2", "Q: x A: yy"], "prompts": ["Q: 1+1? A:", "Q: x A:"],
                   "labels": ["2", "yy"]}
        answer = _post(url + "get_reward", request)
        health = json.loads(_get(url + "health"))
    assert answer == {"rewards": [2.0, 3.0], "extra_logs": {"reward_failed": [0.0, 0.0]}}
    assert seen == [{"responses": [" 2", " yy"], "answers": ["2", "yy"]}]
    connections = health.pop("connections")  # the POST's connection may not be closed yet: 1 or 2 active
    assert health == {"status": "ok", "served": "len", "in_flight": 0, "waiting": 0, "completed": 1,
                      "oldest_call_s": 0.0}
    assert 1 <= connections["active"] <= connections["peak"] <= 2 and connections["refused"] == 0
    assert connections["dropped"] == 0


def test_malformed_request_is_a_400_with_the_reason():
    server = RewardServer(lambda *a: [], name="x")
    with serving(server) as url:
        with pytest.raises(Exception) as info:
            _post(url, {"prompts": "not a list"})
    assert info.value.code == 400
    assert json.loads(info.value.read()) == {"error": "bad request: 'prompts' must be a list of strings"}


@pytest.mark.parametrize("reply, reason", [
    (lambda n, b: rewards_json([1.0]), "answered 1 rewards for 2 rollouts"),
    (lambda n, b: (200, "text/html", b"<html><body>Bad Gateway</body></html>"),
     "answered text/html, not JSON: '<html><body>Bad Gateway</body></html>'"),
    (lambda n, b: rewards_json({"a": 1}), "answered JSON without a 'rewards' list"),
    (lambda n, b: (404, "text/plain", b"nope"), "answered HTTP 404: 'nope'"),
])
def test_unusable_answers_fail_every_rollout_without_retry(reply, reason):
    server = Canned(reply)
    with serving(server) as url:
        outcomes = call(url, batch(["1", "2"]))
    assert server.count == 1
    assert [o.ok for o in outcomes] == [False, False]
    assert outcomes[0].reason == f"reward function reward server {url} raised HttpRewardError: reward server " \
                                 f"{url} {reason}"


def test_non_finite_and_non_numeric_rewards_are_per_rollout_reasons():
    server = Canned(lambda n, b: (200, "application/json", b'{"rewards": [0.5, NaN, "high", null]}'))
    with serving(server) as url:
        outcomes = call(url, batch(["1", "2", "3", "4"]))
    assert outcomes[0].output.reward == 0.5
    assert outcomes[1].reason == f"reward server {url} returned a non-finite reward nan"
    assert outcomes[2].reason == f"reward server {url} returned str, expected a float or a dict with 'reward'"
    assert outcomes[3].reason == f"reward server {url}: no reward and no reason"


def test_token_rewards_pass_through_and_are_checked():
    server = Canned(lambda n, b: (200, "application/json", json.dumps(
        {"rewards": [1.0, 1.0], "token_rewards": [[0.0, 0.5, 0.5], [1.0]]}).encode()))
    with serving(server) as url:
        good, short = call(url, batch(["1", "2"]))
    assert good.output.token_rewards.tolist() == [0.0, 0.5, 0.5]
    assert "token_rewards of shape [1], expected [3]" in short.reason


def test_500_storm_is_retried_a_bounded_number_of_times():
    server = Canned(lambda n, b: (503, "text/plain", b"overloaded"))
    with serving(server) as url:
        outcomes = call(url, batch(["1"]))
    assert server.count == 3  # 1 + max_retries
    assert outcomes[0].attempts == 3
    assert outcomes[0].reason.endswith("answered HTTP 503: 'overloaded' (after 3 attempts)")


def test_transient_500_then_success():
    server = Canned(lambda n, b: (500, "text/plain", b"oops") if n == 1 else rewards_json([0.25]))
    with serving(server) as url:
        [outcome] = call(url, batch(["1"]))
    assert (outcome.output.reward, outcome.attempts, server.count) == (0.25, 2, 2)


def test_slow_server_times_out():
    def slow(n, b):
        time.sleep(1.5)
        return rewards_json([1.0])

    server = Canned(slow)
    policy = CallPolicy(timeout_s=0.5, concurrency=1, max_retries=2, backoff_s=0.01, max_backoff_s=0.01)
    with serving(server) as url:
        start = time.perf_counter()
        # the scorer's client deadline is a second after the caller's (consumers.scorer.services): the caller's
        # deadline decides, not retried; with equal deadlines the client's could fire first, and be retried
        [outcome] = call(url, batch(["1"]), policy, timeout_s=policy.timeout_s + 1.0)
        elapsed = time.perf_counter() - start
    assert outcome.timed_out and outcome.reason.endswith("timed out after 0.5 s")
    assert outcome.attempts == 1 and elapsed < 1.4


def test_headers_come_from_the_environment_and_never_appear_in_reasons():
    secret = "Bearer s3cr3t-token"
    server = Canned(lambda n, b: (401, "text/plain", b"denied"))
    with serving(server) as url:
        [outcome] = call(url, batch(["1"]), headers_env={"Authorization": "RM_TOKEN"},
                         environ={"RM_TOKEN": secret})
    assert server.headers_seen[0]["Authorization"] == secret
    assert "s3cr3t" not in outcome.reason and "answered HTTP 401" in outcome.reason
    with pytest.raises(ValueError, match=r"environment variable\(s\) \['RM_TOKEN'\] not set"):
        headers_from_env({"Authorization": "RM_TOKEN"}, {})


def test_unreachable_url_at_start_names_the_field():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(ValueError, match=rf"^scorer.reward_url http://127.0.0.1:{port}/get_reward is "
                                             "unreachable: "):
            check_reachable(f"http://127.0.0.1:{port}/get_reward?key=secret", timeout_s=2)
    assert safe_url("https://user:pw@rm.example:8443/r?key=1#x") == "https://rm.example:8443/r"
    with pytest.raises(ValueError, match="must be an http:// or https:// URL"):
        HttpRewardClient("ftp://example.com/")


def test_reward_server_command_serves_a_builtin_reward():
    proc = subprocess.Popen([sys.executable, "-m", "stream_rl.cli.main", "reward-server", "exact_match"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _read_line(proc, timeout_s=60)
        assert line.startswith("reward server serving exact_match at http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1]
        check_reachable(url)
        outcomes = call(url, batch(["42", "42"], ["42</s>", "41"]))
        assert [o.output.reward for o in outcomes] == [1.0, 0.0]
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_reward_server_command_refuses_an_unknown_target():
    result = subprocess.run([sys.executable, "-m", "stream_rl.cli.main", "reward-server", "no_such_reward"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("reward-server: 'no_such_reward' is not a built-in reward (")


def test_reward_model_directory_is_served_with_the_models_own_scores(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from consumers.scorer.reward_model import RewardModelScorer
    from stream_rl.cli.reward_server_cmd import served_scorer
    from stream_rl.demo.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reference = RewardModelScorer.from_dir(tmp_path, input_mode="text")
    texts = [("1+2=", "3"), ("10+20=", "30")]
    expected = reference.scores([reference.token_ids(_Texts(p, r)) for p, r in texts])
    server = RewardServer(served_scorer(str(tmp_path), batch_size=1, device="cpu", dtype="float32"),
                          name="rm", batch_size=1)
    with serving(server) as url:
        answer = _post(url, {"prompts": [p for p, _ in texts], "responses": [r for _, r in texts]})
    assert answer["rewards"] == pytest.approx(expected, abs=1e-6)
    assert answer["rewards"][0] != answer["rewards"][1]


class _Texts:
    def __init__(self, prompt: str, response: str) -> None:
        self.prompt_text, self.response_text = prompt, response


def _post(url: str, body: dict) -> dict:
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def _get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert lines and lines[0], f"no URL line; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
    return lines[0].strip()
