"""Reward calls on the real broker (consumers.scorer.services): a hanging reward is dead-lettered with its
timeout while the scorer goes on scoring and committing; a reward server (stream_rl.rewards.server, a real HTTP
server on 127.0.0.1) scores rollouts, and one answering 503 is retried a bounded number of times, then its
rollouts are dead-lettered with the reason (or counted as zeroed with on_reward_error = "zero")."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from support import slow_rewards
from support.messages import rollout_for_scoring
from support.scorer import ScorerThread, group_rollouts, send_rollouts
from support.topics import read_records
from support.waiting import wait_for

from consumers.scorer.builtin_rewards import exact_match
from consumers.scorer.config import ScorerConfig
from stream_rl.rewards.server import RewardServer, per_rollout_scorer
from stream_rl.transport.client import Transport

torch.set_num_threads(1)


@pytest.mark.broker
def test_timing_out_reward_is_dead_lettered_while_the_scorer_goes_on(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 1, "scored": 1, "dlq": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    hanging = [rollout_for_scoring(7, s, metadata={"hang": "yes"}) for s in (0, 1)]
    send_rollouts(t, group_rollouts(0, 1) + hanging)
    scfg = ScorerConfig(reward_fn="support.slow_rewards:hang_when_asked",
                        batch_size=6, poll_timeout_s=0.3, reward_timeout_s=0.5, reward_max_retries=3)
    scorer = ScorerThread(cfg, scfg)
    try:
        wait_for(lambda: len(read_records(t, t.names.dlq, "dead_letter")) >= 2, "2 dead letters", 40, watch=[scorer])
        later = group_rollouts(1, 1)
        send_rollouts(t, later)  # the scorer goes on after the timeouts
        scored = wait_for(lambda: (s := read_records(t, t.names.scored, "scored_rollout")) and len(s) >= 8 and s,
                          "8 scored rollouts", 40, watch=[scorer])
        stats = scorer.finish()
    finally:
        slow_rewards.RELEASE.set()
    assert (stats.scored, stats.rejected) == (8, 2) and stats.commits >= 2
    assert sorted(s.value.reward for s in scored) == [0.0] * 4 + [1.0] * 4
    letters = [d.value for d in read_records(t, t.names.dlq, "dead_letter")]
    assert [d.error_type for d in letters] == ["Timeout", "Timeout"]
    assert all(d.reason.endswith("timed out after 0.5 s") for d in letters)
    assert {d.source_offset for d in letters} == {4, 5}


class _Unavailable(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        return

    def do_GET(self) -> None:  # /health answers: the server is reachable at start-up
        self._reply(200, b'{"status": "ok"}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posts += 1
        self._reply(503, b'{"error": "overloaded"}')

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve(server) -> str:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    return f"http://{host}:{port}/"


@pytest.mark.broker
def test_reward_server_scores_and_a_503_storm_is_bounded_then_dead_lettered(make_config):
    cfg = make_config(**{"topics.partitions": {"rollouts": 1, "scored": 1, "dlq": 1}})
    t = Transport(cfg, "test")
    t.ensure_topics()
    good = RewardServer(per_rollout_scorer(exact_match, "exact_match"), name="exact_match")
    storm = ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    storm.posts = 0
    good_url, storm_url = _serve(good), _serve(storm)
    try:
        send_rollouts(t, group_rollouts(0, 1))
        scfg = ScorerConfig(reward_fn=None, reward_url=good_url, reward_url_weight=2.0, batch_size=4,
                            poll_timeout_s=0.3)
        scorer = ScorerThread(cfg, scfg)
        scored = wait_for(lambda: (s := read_records(t, t.names.scored, "scored_rollout")) and len(s) >= 4 and s,
                          "4 scored rollouts", 40, watch=[scorer])
        scorer.finish()
        assert sorted(s.value.reward_components["reward_server"] for s in scored) == [0.0, 0.0, 2.0, 2.0]

        send_rollouts(t, group_rollouts(1, 1))
        storm_cfg = scfg.model_copy(update={"reward_url": storm_url, "reward_max_retries": 2,
                                            "reward_backoff_s": 0.01, "reward_max_backoff_s": 0.02})
        scorer = ScorerThread(cfg, storm_cfg)
        wait_for(lambda: len(read_records(t, t.names.dlq, "dead_letter")) >= 4, "4 dead letters", 40,
                 watch=[scorer])
        stats = scorer.finish()
    finally:
        for server in (good, storm):
            server.shutdown()
            server.server_close()
    assert stats.rejected == 4 and storm.posts == 3  # one batch of 4: 1 + 2 retries
    letters = [d.value for d in read_records(t, t.names.dlq, "dead_letter")]
    assert {d.error_type for d in letters} == {"HttpRewardError"}
    assert all(d.reason.startswith("reward 'reward_server': reward function reward server ") and
               d.reason.endswith("answered HTTP 503: '{\"error\": \"overloaded\"}' (after 3 attempts)")
               for d in letters)
