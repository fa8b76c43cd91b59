"""The reward transport against hostile servers (stream_rl.rewards.http, stream_rl.rewards.judge): real loopback HTTP
servers that redirect to another host, close mid-answer, flood or trickle. Credentials never leave their origin,
and no other host's answer becomes a reward; a connection closed mid-answer is a retried HttpRewardError; an
answer is capped in bytes; a trickling server cannot keep the reading thread alive past the call's deadline."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc

import pytest
from support.hostile_http import Scripted, reply, rewards, serving

from stream_rl.rewards.calls import CallPolicy, RewardCaller, RewardRequest
from stream_rl.rewards.http import MAX_ANSWER_BYTES, HttpRewardClient, HttpRewardError
from stream_rl.rewards.judge import JudgeError, JudgeReward, JudgeSettings

POLICY = CallPolicy(timeout_s=3.0, concurrency=2, max_retries=2, backoff_s=0.01, max_backoff_s=0.02)
SECRET = "Bearer s3cr3t-token"


def one_rollout() -> list[RewardRequest]:
    return [RewardRequest("q", "so #### 4", "4", {}, response_length=3)]


def call(url: str, policy: CallPolicy = POLICY, **client_kw):
    client = HttpRewardClient(url, timeout_s=policy.timeout_s, headers_env={"Authorization": "RM_TOKEN"},
                              environ={"RM_TOKEN": SECRET}, **client_kw)
    with RewardCaller(client, policy) as caller:
        return caller.call(one_rollout())


def redirect_to(location: str, status: int = 302):
    return lambda handler, n: reply(handler, status, b"", headers=[("Location", location)])


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_to_another_host_is_refused_and_the_token_stays_home(status):
    elsewhere = Scripted(rewards([1.0]))
    with serving(elsewhere):
        target = f"http://localhost:{elsewhere.port}/steal"  # another host and another port
        redirector = Scripted(redirect_to(target, status))
        with serving(redirector) as url:
            [outcome] = call(url)
    assert elsewhere.seen == []  # nothing, the token least of all, went to the other host
    assert len(redirector.seen) == 1  # refused, not retried
    assert not outcome.ok and outcome.error_type == "HttpRewardError"
    assert outcome.reason.endswith(f"reward server {url} redirected (HTTP {status}) to another origin, {target}: "
                                   f"refused (credentials are never sent to another origin)")
    assert "s3cr3t" not in outcome.reason


def test_the_judge_never_sends_its_api_key_to_a_redirect_target():
    elsewhere = Scripted(lambda h, n: reply(h, 200, {"choices": [{"message": {"content": "score: 10"}}]}))
    with serving(elsewhere):
        redirector = Scripted(redirect_to(f"http://localhost:{elsewhere.port}/v1/chat/completions"))
        with serving(redirector) as url:
            judge = JudgeReward(JudgeSettings(base_url=url + "v1", model="m", template="{response}",
                                              api_key_env="JUDGE_KEY"),
                                timeout_s=3.0, environ={"JUDGE_KEY": "sk-judge-secret"})
            with pytest.raises(HttpRewardError, match="redirected \\(HTTP 302\\) to another origin") as info:
                judge("q", "an answer", None, {})
    assert elsewhere.seen == [] and not info.value.retriable
    assert redirector.seen[0]["headers"]["Authorization"] == "Bearer sk-judge-secret"  # the configured origin
    assert "sk-judge-secret" not in str(info.value)


def huge_score(text: str) -> int:
    """A judge parser whose score is beyond a float."""
    return 10**400


def test_the_judge_scores_through_the_transport_and_refuses_a_score_beyond_a_float():
    server = Scripted(lambda h, n: reply(h, 200, {"choices": [{"message": {"content": "fine. score: 7"}}]}))
    common = {"model": "m", "template": "{response}", "api_key_env": "JUDGE_KEY"}
    with serving(server) as url:
        judge = JudgeReward(JudgeSettings(base_url=url + "v1", **common), timeout_s=3.0, environ={"JUDGE_KEY": "k"})
        assert judge("q", "an answer", None, {}) == 7.0
        huge = JudgeReward(JudgeSettings(base_url=url + "v1", parser=f"{__name__}:huge_score", **common),
                           timeout_s=3.0, environ={"JUDGE_KEY": "k"})
        with pytest.raises(JudgeError, match=r"cannot parse a score \(OverflowError: int too large to convert to "
                                             r"float\) from <judge text redacted: 14 chars>"):
            huge("q", "an answer", None, {})
    assert server.seen[0]["path"] == "/v1/chat/completions"
    assert server.seen[0]["headers"]["Authorization"] == "Bearer k"


def test_a_same_origin_redirect_is_followed_with_its_method_body_and_token():
    def script(handler, n):
        if handler.path == "/old":
            reply(handler, 307, b"", headers=[("Location", "/new")])
        else:
            reply(handler, 200, {"rewards": [0.75]})

    server = Scripted(script)
    with serving(server) as url:
        [outcome] = call(url + "old")
    assert outcome.ok and outcome.output.reward == 0.75
    old, new = server.seen
    assert (old["path"], new["path"], new["method"]) == ("/old", "/new", "POST")
    assert new["body"] == old["body"] and new["headers"]["Authorization"] == SECRET


def _truncated(handler, n):
    """Promise 100 bytes, send 10 and close: the connection ends mid-answer."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", "100")
    handler.end_headers()
    handler.wfile.write(b'{"rewards"')
    handler.close_connection = True


def test_a_connection_closed_mid_answer_is_retried_then_succeeds():
    server = Scripted(lambda h, n: _truncated(h, n) if n == 1 else reply(h, 200, {"rewards": [0.5]}))
    with serving(server) as url:
        [outcome] = call(url)
    assert (outcome.ok, outcome.output.reward, outcome.attempts) == (True, 0.5, 2)


def test_a_connection_always_closed_mid_answer_is_a_bounded_reward_error():
    server = Scripted(_truncated)
    with serving(server) as url:
        [outcome] = call(url)
    assert len(server.seen) == 3 and outcome.attempts == 3  # 1 + max_retries
    assert outcome.error_type == "HttpRewardError"
    assert outcome.reason.endswith(f"reward server {url} closed the connection mid-answer (IncompleteRead) "
                                   "(after 3 attempts)")


def _flood(declare: bool):
    """50 MiB of spaces, declared or not, until the client stops reading."""
    chunk = b" " * (1 << 20)

    def script(handler, n):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if declare:
            handler.send_header("Content-Length", str(50 * len(chunk)))
        handler.end_headers()
        try:
            for _ in range(50):
                handler.wfile.write(chunk)
        except OSError:  # the client hung up: what the cap is for
            pass
        handler.close_connection = True

    return script


@pytest.mark.parametrize("declare", [False, True], ids=["undeclared", "declared"])
def test_an_answer_over_the_cap_is_refused_without_being_held(declare):
    server = Scripted(_flood(declare))
    with serving(server) as url:
        client = HttpRewardClient(url, timeout_s=5.0)
        tracemalloc.start()
        try:
            with pytest.raises(HttpRewardError) as info:
                client(["q"], ["r"], ["a"], [{}])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert not info.value.retriable
    if declare:
        assert str(info.value) == (f"reward server {url} answered 52428800 bytes, over the cap of "
                                   f"{MAX_ANSWER_BYTES} bytes")
        assert peak < 1 << 20
    else:
        assert str(info.value) == f"reward server {url} answered more than the cap of {MAX_ANSWER_BYTES} bytes"
        assert peak < 2.5 * MAX_ANSWER_BYTES  # the chunks up to the cap (and their join), never 50 MiB


def _trickle(where: str):
    """One byte every 20 ms, in the headers or in the body, until the test stops the server."""

    def script(handler, n):
        sock = handler.connection
        if where == "headers":
            head = b"HTTP/1.0 200 OK\r\nX-Slow: " + b"x" * 10_000
        else:
            head = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n"
            sock.sendall(head)
            head = b" " * 10_000
        for byte in (head[i:i + 1] for i in range(len(head))):
            if handler.server.stop.wait(0.02):
                return
            try:
                sock.sendall(byte)
            except OSError:
                return
        handler.close_connection = True

    return script


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickling_server_cannot_keep_the_reader_past_its_deadline(where):
    server = Scripted(_trickle(where))
    errors: list[BaseException] = []

    def read() -> None:
        try:
            HttpRewardClient(url, timeout_s=0.5)(["q"], ["r"], ["a"], [{}])
        except BaseException as exc:  # noqa: BLE001 - kept for the assertions below
            errors.append(exc)

    with serving(server) as url:
        start = time.monotonic()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=3.0)
        elapsed = time.monotonic() - start
        assert not reader.is_alive(), "the reader outlived its deadline while the server trickled"
    assert elapsed < 1.5
    [error] = errors
    assert isinstance(error, HttpRewardError) and error.retriable
    assert str(error) == f"reward server {url} timed out: no complete answer within the call's deadline"


def test_a_caller_deadline_frees_the_thread_of_a_trickled_call():
    """Through RewardCaller: a call abandoned at the caller's deadline (0.5 s) leaves its pool thread reading the
    trickle only until the client's own deadline (1 s), so the pool is back to its size soon after."""
    server = Scripted(_trickle("body"))
    policy = CallPolicy(timeout_s=0.5, concurrency=1, max_retries=0, backoff_s=0.01, max_backoff_s=0.01)
    with serving(server) as url:
        client = HttpRewardClient(url, timeout_s=1.0)
        with RewardCaller(client, policy) as caller:
            [outcome] = caller.call(one_rollout())
            assert outcome.timed_out and caller._pool.threads == 2  # the abandoned reader and its replacement
            deadline = time.monotonic() + 3.0
            while caller._pool.threads > 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert caller._pool.threads == 1  # the replacement only: the abandoned reader ended


def test_nothing_listening_is_a_retriable_unreachable_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: connections are refused
        [outcome] = call(f"http://127.0.0.1:{port}/")
    assert outcome.attempts == 3 and "unreachable: [Errno 111] Connection refused" in outcome.reason


def test_the_environments_proxy_is_used_as_urllib_did(monkeypatch):
    proxy = Scripted(rewards([0.5]))
    with serving(proxy) as proxy_url:
        monkeypatch.setenv("http_proxy", proxy_url.replace("http://", "http://user:pw@"))
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        [outcome] = call("http://reward.invalid:9/get_reward")
    assert outcome.ok and outcome.output.reward == 0.5
    [seen] = proxy.seen
    assert seen["path"] == "http://reward.invalid:9/get_reward"  # the absolute URL, to a forward proxy
    assert seen["headers"]["Proxy-Authorization"] == "Basic dXNlcjpwdw=="  # user:pw
