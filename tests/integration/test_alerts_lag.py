"""``consumer_lag`` on the real local broker, and the CLI run a new user makes (issue 13): a healthy run (prompts
loaded ahead, a trainer that commits only at checkpoints) raises no lag alert, a consumer that really falls behind
does; the sampler/trainer mismatch alert judges only rollouts of lag 0; a stopped role leaves no endpoint file, and
``stream-rl report`` names the alerts the run raised."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.messages import prompt
from support.topics import read_values
from support.trainer import scored
from support.waiting import wait_for
from typer.testing import CliRunner

from stream_rl.cli.main import app
from stream_rl.telemetry.role import RoleTelemetry
from stream_rl.transport.client import Transport

pytestmark = pytest.mark.broker

FAST_LAG = {"telemetry.lag_interval_s": 0.2, "telemetry.heartbeat_interval_s": 1.0, "telemetry.http": False,
            "alerts.consumer_lag.max_records": 5, "alerts.consumer_lag.for_s": 1.0}


def lag_alerts(transport) -> list:
    return [a for a in read_values(transport, transport.names.alerts, "alert") if a.name == "consumer_lag"]


def run_role_for(telemetry, source, seconds: float, batch: int = 0, feed=None) -> None:
    """Tick like a role loop for ``seconds``: each ~0.25 s read up to ``batch`` records (0: read nothing) and call
    ``feed()`` (the upstream writing more)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        telemetry.tick()
        if batch:
            source.poll(0.1, max_records=batch)  # fetched: the position moves
            telemetry.records_in("t", 0, {tp: source.position(*tp) for tp in source.assignment()})
        if feed is not None:
            feed()
        time.sleep(0.25)


def test_prompts_loaded_ahead_raise_no_lag_alert_and_a_consumer_falling_behind_does(make_config):
    cfg = make_config(**FAST_LAG, **{"topics.partitions.prompts": 1, "topics.partitions.rollouts": 1})
    transport = Transport(cfg, "producer")
    transport.ensure_topics()
    sink = transport.sink()
    for i in range(200):  # loaded ahead: 200 prompts behind from the start, 40x the bound
        sink.send(transport.names.prompts, prompt(i), key=f"p{i}")
    sink.flush()
    group = transport.names.group("producers")
    source = transport.source([transport.names.prompts], group, "prompt", sink)
    producer = RoleTelemetry(cfg, "producer", transport, group=group, topics=[transport.names.prompts])
    producer.attach(source, sink).set_ready(version=0)
    try:
        wait_for(lambda: source.poll(0.2, max_records=1) or source.assignment(),
                 "assignment", 30)
        run_role_for(producer, source, 4.0, batch=2)  # reads slowly: the backlog falls, it never grows
        assert producer.gauges["lag/position_total"] > 5  # far above the bound the whole time ...
        assert "consumer_lag" not in producer.alerts.open_alerts  # ... and no alert
    finally:
        producer.close()
        source.close()

    scorer_t = Transport(cfg, "scorer")
    scorer_group = scorer_t.names.group("scorers")
    scorer_source = scorer_t.source([scorer_t.names.rollouts], scorer_group, "rollout", scorer_t.sink())
    scorer = RoleTelemetry(cfg, "scorer", scorer_t, group=scorer_group, topics=[scorer_t.names.rollouts])
    scorer.attach(scorer_source, scorer_t.sink()).set_ready(version=0)
    sent = [0]

    def feed():  # producers keep writing rollouts that nobody reads
        from support.messages import rollout

        for _ in range(3):
            sink.send(transport.names.rollouts, rollout(sent[0]), key=f"r{sent[0]}")
            sent[0] += 1
        sink.flush()

    try:
        wait_for(lambda: scorer_source.poll(0.2, max_records=1) is not None
                 and scorer_source.assignment(), "assignment", 30)
        run_role_for(scorer, scorer_source, 4.0, feed=feed)
        assert "consumer_lag" in scorer.alerts.open_alerts
    finally:
        scorer.close()
        scorer_source.close()
        sink.close()
    fired = [a for a in lag_alerts(transport) if a.state == "firing"]
    assert [a.role for a in fired] == ["scorer"] and fired[0].value > 5
    assert fired[0].message.startswith("lag/position_total = ")


# ---------------------------------------------------------------- the CLI, as a user types it


@pytest.fixture
def model_dir(tmp_path):
    from support.trainer import tiny_policy

    from stream_rl.demo.tokenizer import build_tokenizer
    from stream_rl.models import save_model

    return save_model(tiny_policy(seed=0), build_tokenizer(), tmp_path / "policy")


def train_args(cfg, model_dir, **extra) -> list[str]:
    sets = {"kafka.bootstrap_servers": cfg.kafka.bootstrap_servers, "topics.run": cfg.topics.run,
            "run_dir": str(cfg.run_dir), "trainer.model_dir": str(model_dir), "trainer.groups_per_step": 1,
            "trainer.micro_batch_size": 2, "trainer.poll_timeout_s": 0.2, "trainer.max_lag": 10,
            "topics.partitions.scored": 1, **FAST_LAG, "telemetry.http": True, **extra}
    return ["train", *[a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]]


def feed_scored(cfg, groups, version: int = 0) -> Transport:
    """``groups``: per group, its behaviour logprobs (None: log(1/2) per token); 2 samples each, in order."""
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    for p, behavior in enumerate(groups):
        for s in range(2):
            response = [6 + s, 7]
            beh = behavior(response) if callable(behavior) else behavior
            rec = scored(p, s, version=version, reward=float(s == 0), response_ids=response, behavior=beh)
            sink.send(transport.names.scored, rec, key=rec.group_id)
        sink.flush()
    sink.close()
    return transport


def other_run(make_config, tmp_path, name: str):
    return make_config(**{"topics.run": f"{make_config().topics.run}-{name}", "run_dir": str(tmp_path / name),
                          "topics.partitions.scored": 1})


def test_cli_train_committing_rarely_raises_no_lag_alert_and_leaves_no_endpoint(make_config, model_dir):
    cfg = make_config(**{"topics.partitions.scored": 1})
    transport = feed_scored(cfg, [None] * 12)  # 24 records ahead of a trainer that commits only at the end
    result = CliRunner().invoke(app, train_args(cfg, model_dir, **{
        "trainer.max_steps": 6, "trainer.checkpoint_every": 1000, "alerts.logprob_mismatch.enabled": False}))
    assert result.exit_code == 0, result.output
    assert lag_alerts(transport) == []
    endpoints = Path(cfg.run_dir) / "endpoints"
    assert endpoints.is_dir() and list(endpoints.glob("*.json")) == []  # recorded while it ran, removed at stop
    report = CliRunner().invoke(app, ["report", str(cfg.run_dir)])
    assert report.exit_code == 0, report.output
    assert "alerts: none" in report.stdout


STOP_ON_MISMATCH = {"alerts.logprob_mismatch.action": "stop", "alerts.logprob_mismatch.max_abs_diff": 0.5,
                    "trainer.checkpoint_every": 1000}
FAR = [-5.0, -5.0]  # behaviour logprobs far from the tiny model's (near -log(16) = -2.8): |mu - pi| > 2


def test_cli_mismatch_alert_ignores_one_version_of_lag(make_config, model_dir, tmp_path):
    """Step 1 trains group p0 (sampled by v0, exact logprobs) at v0; step 2 trains p1 (also v0, far logprobs) at
    v1: one version of lag is staleness, not a sampler/trainer mismatch, so the stop alert must not fire."""
    from support.trainer import exact_logprobs, tiny_policy

    exact = tiny_policy(seed=0)  # the weights saved in model_dir
    cfg = other_run(make_config, tmp_path, "lag1")
    feed_scored(cfg, [lambda response: exact_logprobs(exact, (3, 4, 5), response).tolist(), FAR])
    result = CliRunner().invoke(app, train_args(cfg, model_dir, **{**STOP_ON_MISMATCH, "trainer.max_steps": 2}))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["mismatch/on_policy_samples"] for r in rows] == [2.0, 0.0]
    assert rows[0]["mismatch/logp_abs_diff"] < 1e-3  # lag 0, exact sampler: no mismatch
    assert "mismatch/logp_abs_diff" not in rows[1]  # no lag-0 sample: left out, not 0
    assert rows[1]["mismatch/offpolicy_logp_abs_diff"] > 2.0 and rows[1]["mismatch/kl_mu_prox"] > 0


def test_cli_a_run_stopped_by_an_alert_is_reported_with_it(make_config, model_dir, tmp_path):
    cfg = other_run(make_config, tmp_path, "stop")
    feed_scored(cfg, [FAR])  # lag 0 and far: a real sampler/trainer mismatch
    result = CliRunner().invoke(app, train_args(cfg, model_dir, **{**STOP_ON_MISMATCH, "trainer.max_steps": 3}))
    assert result.exit_code == 3, result.output
    assert "stopped by alert: alert logprob_mismatch (action stop)" in result.output
    report = CliRunner().invoke(app, ["report", str(cfg.run_dir)])
    assert report.exit_code == 0, report.output
    assert "warnings: none" not in report.stdout
    assert "  - stopped by alert logprob_mismatch on trainer " in report.stdout
    assert "mismatch/logp_abs_diff = " in report.stdout
