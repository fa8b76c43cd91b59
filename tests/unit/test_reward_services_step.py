"""The scorer's reward calls in the pure step (consumers.scorer.services through score_rollouts): a reward server
beside the rule-based reward, on_reward_error = "zero" counted, a hanging function's deadline, the call metrics
(hand-computed percentiles), and the start-up check of scorer.reward_url. Real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import socket
import threading

import pytest
from support.messages import rollout_for_scoring

from consumers.scorer.config import ScorerConfig
from consumers.scorer.scoring import Rejected, load_scoring, score_rollouts
from consumers.scorer.services import CallStats
from stream_rl.rewards.calls import CallOutcome
from stream_rl.rewards.contract import RewardFnError, RewardOutput
from stream_rl.rewards.server import RewardServer, per_rollout_scorer

RELEASE = threading.Event()


def double_length(prompt, response, answer, metadata):
    return 2.0 * len(response)


def hangs_on_eight(prompt, response, answer, metadata):
    if response == "8":
        RELEASE.wait(30)
    return 1.0


def fails_on_eight(prompt, response, answer, metadata):
    if response == "8":
        raise ConnectionError("backend gone")
    return 1.0


@pytest.fixture
def length_server():
    server = RewardServer(per_rollout_scorer(double_length, "double_length"), name="double_length")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def rollouts() -> list:
    return [rollout_for_scoring(0, 0, response_text="7", metadata={"data_source": "add"}),
            rollout_for_scoring(0, 1, response_text="88", metadata={"data_source": "add"})]


def test_reward_server_component_beside_the_rule_based_reward(length_server):
    cfg = ScorerConfig(reward_fn="consumers.scorer.builtin_rewards:exact_match", reward_url=length_server,
                       reward_url_weight=0.5)
    scoring = load_scoring(cfg, "scorer-t")
    try:
        out = score_rollouts(rollouts(), scoring)
        metrics = scoring.services.stats.drain()
    finally:
        scoring.services.close()
    assert [o.reward_components for o in out] == [{"reward_fn": 1.0, "reward_server": 1.0},
                                                  {"reward_fn": 0.0, "reward_server": 2.0}]
    assert [o.reward for o in out] == [2.0, 2.0]
    assert metrics["rewards/reward_server/add/calls"] == 2.0
    assert metrics["rewards/reward_fn/add/errors"] == 0.0 and metrics["rewards/reward_fn/add/timeouts"] == 0.0


def test_hanging_reward_is_rejected_with_its_deadline_and_on_wait_ticks():
    ticks: list[int] = []
    cfg = ScorerConfig(reward_fn=f"{__name__}:hangs_on_eight", reward_timeout_s=1.5)
    scoring = load_scoring(cfg, "scorer-t")
    try:
        out = score_rollouts([rollout_for_scoring(0, 0, response_text="7"),
                              rollout_for_scoring(0, 1, response_text="8")], scoring,
                             on_wait=lambda: ticks.append(1))
        metrics = scoring.services.stats.drain()
    finally:
        RELEASE.set()
        scoring.services.close()
    assert out[0].reward == 1.0
    assert isinstance(out[1], Rejected) and out[1].error_type == "Timeout"
    assert out[1].reason == f"reward call to {hangs_on_eight.__qualname__} timed out after 1.5 s"
    assert len(ticks) >= 1  # liveness while the slow call was in flight
    assert metrics["rewards/reward_fn/none/timeouts"] == 1.0 and metrics["rewards/reward_fn/none/errors"] == 1.0


def test_on_reward_error_zero_scores_zero_and_counts_it():
    cfg = ScorerConfig(reward_fn=f"{__name__}:fails_on_eight", on_reward_error="zero")
    scoring = load_scoring(cfg, "scorer-t")
    try:
        out = score_rollouts([rollout_for_scoring(0, 0, response_text="7"),
                              rollout_for_scoring(0, 1, response_text="8")], scoring)
        metrics = scoring.services.stats.drain()
    finally:
        scoring.services.close()
    assert [o.reward for o in out] == [1.0, 0.0]
    assert metrics["rewards/reward_fn/none/zeroed"] == 1.0 and metrics["rewards/reward_fn/none/errors"] == 1.0


def test_dead_letter_is_the_default_with_the_functions_error_type():
    scoring = load_scoring(ScorerConfig(reward_fn=f"{__name__}:fails_on_eight"), "scorer-t")
    try:
        _, failed = score_rollouts([rollout_for_scoring(0, 0, response_text="7"),
                                    rollout_for_scoring(0, 1, response_text="8")], scoring)
    finally:
        scoring.services.close()
    assert failed.error_type == "ConnectionError"
    assert failed.reason == f"reward function {fails_on_eight.__qualname__} raised ConnectionError: backend gone"


def test_call_metrics_percentiles_by_reward_and_data_source():
    stats = CallStats()
    ok = RewardOutput(1.0)
    for latency in (0.1, 0.2, 0.3, 0.4):
        stats.seen[("judge", "math")].append(CallOutcome(ok, None, 1, latency))
    stats.seen[("judge", "code")].append(CallOutcome(None, "timed out", 3, 2.0, timed_out=True))
    stats.zeroed[("judge", "code")] += 1
    metrics = stats.drain()
    assert metrics["rewards/judge/math/latency_p50_s"] == pytest.approx(0.25)
    assert metrics["rewards/judge/math/latency_p99_s"] == pytest.approx(0.397)  # 0.3 + 0.97 * (0.4 - 0.3)
    assert (metrics["rewards/judge/code/timeouts"], metrics["rewards/judge/code/retries"],
            metrics["rewards/judge/code/errors"], metrics["rewards/judge/code/zeroed"]) == (1.0, 2.0, 1.0, 1.0)
    assert stats.drain() == {}


def test_unreachable_reward_url_at_start_names_the_field():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        with pytest.raises(RewardFnError, match=rf"^scorer.reward_url http://127.0.0.1:{port}/ is unreachable"):
            load_scoring(ScorerConfig(reward_fn=None, reward_url=f"http://127.0.0.1:{port}/"), "scorer-t")


def test_config_refuses_bad_service_settings():
    with pytest.raises(ValueError, match="reward_max_backoff_s must be >= "):
        ScorerConfig(reward_backoff_s=5.0, reward_max_backoff_s=1.0)
    with pytest.raises(ValueError, match="pattern"):
        ScorerConfig(reward_url="ftp://x/")
    with pytest.raises(ValueError, match=r"scorer.judge.template uses \['answer'\]"):
        ScorerConfig(judge={"base_url": "http://127.0.0.1:1/v1", "model": "m", "template": "{answer}"})


def test_status_shows_each_scorers_reward_call_metrics():
    from schemas import Heartbeat
    from stream_rl.operator_tools.status import latest_per_instance, reward_calls

    def beat(role: str, instance: str, at: float, metrics: dict) -> Heartbeat:
        return Heartbeat(role=role, instance_id=instance, host="h", pid=1, state="ready", policy_version=0, step=1,
                         rates={}, metrics=metrics, open_alerts=[], interval_s=5.0, created_at=at)

    beats = [beat("scorer", "scorer-b", 1.0, {"rewards/judge/math/timeouts": 9.0}),
             beat("scorer", "scorer-b", 2.0, {"rewards/judge/math/timeouts": 1.0, "loop/tick_age_s": 0.1,
                                              "rewards/judge/math/latency_p99_s": float("nan")}),
             beat("scorer", "scorer-a", 1.5, {"rewards/reward_fn/none/calls": 16.0}),
             beat("scorer", "scorer-c", 1.5, {"loop/tick_age_s": 0.2}),
             beat("trainer", "trainer-a", 1.5, {"rewards/x": 1.0})]
    assert reward_calls(latest_per_instance(beats)) == {
        "scorer-a": {"rewards/reward_fn/none/calls": 16.0},
        "scorer-b": {"rewards/judge/math/timeouts": 1.0}}
