"""OpenEnv environments served over the network (``producer.environment = "openenv+http://HOST:PORT"``,
producers.openenv_remote) against real servers: openenv-core's own FastAPI app under uvicorn
(support.openenv_server), hostile WebSocket servers written with ``websockets``, and scripted HTTP servers for the
start-up checks. The in-process OpenEnv class (producers.hub_envs) is the reference a served one must equal."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("openenv.core", reason="the envs extra is not installed: pip install -e '.[envs]'")

from producers.environment import EnvironmentLoadError, EnvironmentTimeout, Guarded, load_environment  # noqa: E402
from producers.hub_envs import episode_seed  # noqa: E402
from producers.openenv_remote import RemoteEnvironmentError, RemoteOpenEnvEpisode  # noqa: E402
from schemas import Prompt  # noqa: E402
from support.hostile_http import Scripted, reply, serving  # noqa: E402
from support.openenv_server import served  # noqa: E402


def _prompt(i: int, epoch: int = 0) -> Prompt:
    return Prompt(prompt_id=f"p{i}", epoch=epoch, text="Guess a digit:", group_size=2)


def _play(factory, prompt: Prompt, guesses: list[str]) -> list[tuple]:
    env = factory()
    try:
        env.reset(prompt)
        out = []
        for guess in guesses:
            obs = env.step(guess)
            out.append((obs.text, obs.done, obs.reward, dict(obs.tags)))
            if obs.done:
                break
        return out
    finally:
        env.close()


def test_a_served_environment_plays_exactly_as_the_same_class_in_process():
    in_process = load_environment("openenv:support.openenv_guess:GuessDigit", 10.0)
    with served("GuessDigit") as (url, _):
        remote = load_environment(f"openenv+{url}", 10.0)
        assert remote.name == "GuessDigit"  # the server's /metadata name: the health keys and tags are the class's
        for i in range(4):
            secret = str(episode_seed(f"p{i}/0") % 10)  # GuessDigit's secret is its reset seed mod 10
            wrong = "x" if secret != "x" else "y"
            guesses = [wrong, "5" if secret != "5" else "4", secret]
            played = _play(remote, _prompt(i), guesses)
            assert played == _play(in_process, _prompt(i), guesses)
            assert [p[2] for p in played] == [0.0, 0.1, 1.0]  # the rubric: not a digit, a wrong digit, right
            assert played[-1][:2] == ("right", True) and played[0][3] == {"env": "GuessDigit"}


def test_sessions_end_with_their_play_so_a_server_of_two_sessions_serves_any_number_of_episodes():
    with served("GuessDigit", sessions=2) as (url, _):
        factory = load_environment(f"openenv+{url}", 10.0)
        for i in range(6):  # three times the server's cap, one after another
            assert _play(factory, _prompt(i), ["3"])[0][2] in (0.1, 1.0)
        held = [factory(), factory()]  # the cap is real: two sessions not closed leave no room for a third
        for i, env in enumerate(held):
            env.reset(_prompt(10 + i))
        third = factory()
        with pytest.raises(Exception, match="(?i)capacity|session"):
            third.reset(_prompt(12))
            third.step("1")
        for env in [*held, third]:
            env.close()
        assert _play(factory, _prompt(13), ["3"])  # closed: room again


def test_an_environment_that_raises_floods_or_hangs_in_its_server_fails_only_its_episode():
    with served("Crashing") as (url, _):
        env = load_environment(f"openenv+{url}", 10.0)()
        env.reset(_prompt(0))
        with pytest.raises(RemoteEnvironmentError, match="OpenEnv server Crashing refused step: the game server died"):
            env.step("3")
        env.close()
    with served("HugeFlood") as (url, _):  # 20 MB of observation: over the 16 MiB a message may take
        env = load_environment(f"openenv+{url}", 10.0)()
        env.reset(_prompt(0))
        with pytest.raises(RemoteEnvironmentError, match="closed the session at step: .*1009.*too big"):
            env.step("3")
        env.close()
    with served("Hung") as (url, _):
        env = load_environment(f"openenv+{url}", 1.5)()
        env.reset(_prompt(0))
        started = time.monotonic()
        with pytest.raises(EnvironmentTimeout, match="timed out after 1.5 s"):
            env.step("3")
        env.close()  # the hung call's socket is closed: its thread ends instead of waiting 60 s
        assert time.monotonic() - started < 8


def test_a_hung_answer_past_the_sessions_own_deadline_is_the_environment_timeout_not_a_socket_error():
    """The session's socket waits as long as the episode's deadline: when its clock fires first (a loaded machine),
    the episode still fails with the deadline's error, not the socket library's TimeoutError (CI saw that race)."""
    from producers.openenv_remote import remote_factory

    with served("Hung") as (url, _):
        factory, _name = remote_factory(url, 0.5)
        episode = factory()  # the bare session, without the Guarded thread and its clock
        episode.reset(_prompt(0))
        with pytest.raises(EnvironmentTimeout, match=r"step timed out after 0.5 s \(producer.env_timeout_s\)"):
            episode.step("3")
        episode.close()


def test_a_server_killed_mid_episode_fails_that_episode_and_the_next_one_is_refused_with_the_reason():
    with served("GuessDigit") as (url, proc):
        factory = load_environment(f"openenv+{url}", 10.0)
        env = factory()
        env.reset(_prompt(0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with pytest.raises(Exception) as dead:
            env.step("3")
        assert not isinstance(dead.value, EnvironmentTimeout)  # refused at once, not waited out
        env.close()
        with pytest.raises(OSError):  # a new episode cannot connect: its group fails with that reason
            factory().reset(_prompt(1))


@contextmanager
def _ws_server(answer):
    """A WebSocket server at ``ws://127.0.0.1:PORT/ws`` (its /health and /schema are not served: use
    :class:`RemoteOpenEnvEpisode` directly) whose every answer is ``answer(message)`` (None: say nothing)."""
    from websockets.sync.server import serve

    def handler(ws):
        try:
            for raw in ws:
                out = answer(json.loads(raw))
                if out is not None:  # None: say nothing (to "close": a server that neither answers nor closes)
                    ws.send(out)
        except Exception:
            pass

    server = serve(handler, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"ws://127.0.0.1:{server.socket.getsockname()[1]}/ws"
    finally:
        server.shutdown()


OBSERVATION = json.dumps({"type": "observation", "data": {"observation": {"feedback": "ok"}, "reward": 0.0,
                                                          "done": False}})


NOT_FINITE = (ValueError, "Observation.reward must be a finite number or None")  # the in-process environments' check


@pytest.mark.parametrize("step_answer, error", [
    ("not json {", (RemoteEnvironmentError, "not JSON")),
    (json.dumps({"type": "state", "data": {}}), (RemoteEnvironmentError, "with 'state', not an observation")),
    (json.dumps({"type": "error", "data": {"message": "x" * 5000}}), (RemoteEnvironmentError, "refused step: x{300}$")),
    (json.dumps({"type": "observation", "data": {"observation": "flat", "done": False}}),
     (RemoteEnvironmentError, "not an object")),
    ('{"type": "observation", "data": {"observation": {}, "reward": NaN}}', NOT_FINITE),
    (json.dumps({"type": "observation", "data": {"observation": {}, "reward": "1"}}), NOT_FINITE),
    ("[" * 100_000 + "]" * 100_000, (RemoteEnvironmentError, "not JSON")),
])
def test_an_answer_that_is_not_an_observation_fails_the_episode_with_the_reason(step_answer, error):
    def answer(message):
        return OBSERVATION if message["type"] == "reset" else (None if message["type"] == "close" else step_answer)

    with _ws_server(answer) as ws_url:
        env = RemoteOpenEnvEpisode(ws_url, "guess", "Hostile", 5.0)
        env.reset(_prompt(0))
        with pytest.raises(error[0], match=error[1]):
            env.step("3")
        started = time.monotonic()
        env.close()  # this server never closes on "close": ours waits at most its bound
        assert time.monotonic() - started < 6


def test_a_server_that_stalls_is_waited_for_at_most_the_deadline_even_without_the_guard():
    def answer(message):
        if message["type"] == "step":
            time.sleep(4)
        return OBSERVATION

    with _ws_server(answer) as ws_url:
        env = RemoteOpenEnvEpisode(ws_url, "guess", "Stalling", 1.0)
        env.reset(_prompt(0))
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            env.step("3")
        assert time.monotonic() - started < 3
        env.close()


def _scripted(routes: dict):
    def script(handler, n):
        status, body, *headers = routes.get(handler.path, (404, {"detail": "Not Found"}))
        reply(handler, status, body, headers[0] if headers else ())
    return Scripted(script)


@pytest.mark.parametrize("routes, reason", [
    ({}, "/health answered HTTP 404, not 200"),
    ({"/health": (200, {"status": "healthy"})}, "schema answered HTTP 404"),
    ({"/health": (200, {}), "/schema": (200, b"<html>")}, "/schema is not JSON"),
    ({"/health": (200, {}), "/schema": (200, {"observation": {}})}, "names no action"),
    ({"/health": (200, {}), "/schema": (200, {"action": {"properties": {"n": {"type": "integer"},
                                                                         "metadata": {"type": "string"}}}})},
     r"no string field .*\(fields: n, metadata\)"),
    ({"/health": (302, b"", [("Location", "http://example.invalid/health")])}, "another origin"),
])
def test_a_url_that_is_not_an_openenv_server_is_refused_at_start_naming_the_setting(routes, reason):
    with serving(_scripted(routes)) as url:
        shown = r"producer.environment 'openenv\+http://127.0.0.1:\d+/?'"
        with pytest.raises(EnvironmentLoadError, match=f"{shown}.*{reason}"):
            load_environment(f"openenv+{url}", 10.0)


def test_unreachable_and_malformed_urls_and_process_isolation_are_refused_at_start():
    with pytest.raises(EnvironmentLoadError, match="not reachable"):
        load_environment("openenv+http://127.0.0.1:9/", 10.0)  # the discard port: nothing listens
    with pytest.raises(EnvironmentLoadError, match=r"must be http\(s\)://HOST:PORT"):
        load_environment("openenv+ftp://127.0.0.1:21", 10.0)
    with pytest.raises(EnvironmentLoadError, match="user:\\*\\*\\*@|not reachable") as refused:
        load_environment("openenv+http://user:secret@127.0.0.1:9/", 10.0)
    assert "secret" not in str(refused.value)
    with pytest.raises(EnvironmentLoadError, match="env_isolation = 'process' with a served environment"):
        load_environment("openenv+http://127.0.0.1:9/", 10.0, isolation="process")


def test_the_producers_guard_closes_a_served_session_after_a_failed_play():
    with served("GuessDigit", sessions=1) as (url, _):
        factory = load_environment(f"openenv+{url}", 10.0)
        for i in range(3):  # one session at a time: each Guarded episode must give its session back
            env = factory()
            assert isinstance(env, Guarded)
            env.reset(_prompt(i))
            env.step("3")
            env.close()
