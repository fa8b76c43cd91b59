"""The trainer loop's alert actions on the in-process bus (``memory://``): a NaN loss and a ``stop`` alert end the
trainer with exit code 3 and no bad weights published; a ``pause`` alert stops consuming until it resolves.

Moved from tests/integration/test_alerts_integration.py (same assertions); the waits that slept to show that
nothing happens now wait for an observable state instead: a lag measurement that covers the alert's ``for_s``,
a number of polls made while paused."""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from support.topics import committed, heartbeats, read_values
from support.trainer import scored
from support.waiting import wait_for

from consumers.trainer.trainer import Trainer, trainer_group
from stream_rl.storage.checkpoint import complete_checkpoints, load_checkpoint
from stream_rl.transport.client import Transport

torch.set_num_threads(1)


def trainer_config(make_config, model_dir, **overrides):
    base = {"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 1, "trainer.micro_batch_size": 2,
            "trainer.poll_timeout_s": 0.2, "trainer.lr": 1e-3, "trainer.checkpoint_every": 1,
            "topics.partitions.scored": 1, "telemetry.http": False}
    return make_config(**{**base, **overrides})


def send_samples(transport, sink, prompts, samples=(0, 1), version: int = 0) -> None:
    for p in prompts:
        for s in samples:
            rec = scored(p, s, version=version, reward=float(s == 0), response_ids=[6 + s, 7])
            sink.send(transport.names.scored, rec, key=rec.group_id)
    sink.flush()


class PollCount:
    """Counts the polls a trainer's source makes while paused (the test's view of the loop, no hook in it)."""

    def __init__(self, source) -> None:
        self.source, self.paused, self._poll = source, 0, source.poll
        source.poll = self

    def __call__(self, *args, **kwargs):
        records = self._poll(*args, **kwargs)
        self.paused += self.source.paused
        return records


@contextmanager
def running_trainer(cfg):
    """A ``Trainer`` of ``cfg`` run the way the CLI does (``run_role``: AlertStop -> exit code 3) on a thread, beside
    a test transport and sink: yields ``(transport, sink, trainer, thread, errors)``; on exit the trainer is stopped
    and everything closed. ``errors`` collects what the thread raised (typer.Exit for an alert stop)."""
    from stream_rl.cli.config import agreements
    from stream_rl.cli.roles_cmd import run_role

    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    trainer = Trainer(cfg, cfg.trainer, agreements=agreements(cfg))
    stop, errors = threading.Event(), []

    def target():
        try:
            run_role(lambda _cfg, stop_event: trainer.run(stop_event), cfg, stop_event=stop)
        except BaseException as exc:  # surfaced to the test
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield transport, sink, trainer, thread, errors
    finally:
        stop.set()
        thread.join(30)
        trainer.close()
        sink.close()


def read_alerts(transport) -> list:
    return read_values(transport, transport.names.alerts, "alert")


def rows(cfg) -> list[str]:
    path = Path(cfg.run_dir) / "metrics.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


def manifest_versions(transport) -> list[int]:
    return [m.version for m in read_values(transport, transport.names.weights, "weights_manifest")]


def test_nan_loss_stops_the_trainer_with_code_3_and_no_nan_weights_are_published(make_config, model_dir):
    cfg = trainer_config(make_config, model_dir, **{"trainer.max_steps": 4})
    with running_trainer(cfg) as (transport, sink, trainer, thread, errors):
        send_samples(transport, sink, [0])  # step 1: healthy, version 1 published, checkpoint step 1
        wait_for(lambda: len(rows(cfg)) >= 1 and complete_checkpoints(Path(cfg.run_dir) / "checkpoints"), "step 1")
        with torch.no_grad():  # the trainer is idle, waiting for data: poison the output layer
            dict(trainer.engine.module.named_parameters())["policy.lm_head.weight"].fill_(math.nan)
        send_samples(transport, sink, [1])  # step 2: NaN logits -> NaN loss
        thread.join(60)
        assert not thread.is_alive(), "the trainer did not stop on the NaN loss"

    assert len(errors) == 1 and getattr(errors[0], "exit_code", None) == 3, errors  # typer.Exit(3) from run_role
    alerts = read_alerts(transport)
    firing = {a.name: a for a in alerts if a.state == "firing"}
    assert "loss_nonfinite" in firing
    assert (firing["loss_nonfinite"].action, firing["loss_nonfinite"].role) == ("stop", "trainer")
    assert firing["loss_nonfinite"].instance_id == trainer.transport.instance_id
    assert manifest_versions(transport) == [1]  # nothing after the NaN step
    # the newest checkpoint is the healthy step 1 (finite weights): a --resume loads it, not the NaN state
    root = Path(cfg.run_dir) / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000001"]
    assert load_checkpoint(root / "step-00000001").version == 1


def test_stop_alert_writes_a_final_checkpoint_and_publishes_no_weights(make_config, model_dir):
    # the behaviour logprobs of the crafted rollouts (log 1/2) are far from the tiny policy's: mismatch > 0.01
    cfg = trainer_config(make_config, model_dir, **{
        "trainer.max_steps": 3, "trainer.checkpoint_every": 100,
        "alerts.logprob_mismatch.max_abs_diff": 0.01, "alerts.logprob_mismatch.action": "stop"})
    with running_trainer(cfg) as (transport, sink, trainer, thread, errors):
        send_samples(transport, sink, [0])
        thread.join(60)
        assert not thread.is_alive(), "the trainer did not stop on the alert"

    assert len(errors) == 1 and getattr(errors[0], "exit_code", None) == 3, errors
    firing = [a for a in read_alerts(transport) if a.state == "firing" and a.name == "logprob_mismatch"]
    assert len(firing) == 1 and firing[0].action == "stop" and firing[0].value > 0.01
    assert manifest_versions(transport) == []  # the alerting step's weights were never broadcast
    root = Path(cfg.run_dir) / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000001"]  # the final checkpoint
    ckpt = load_checkpoint(root / "step-00000001")
    assert ckpt.step == 1 and ckpt.version == 0
    assert committed(transport, trainer_group(cfg)) == {(transport.names.scored, 0): 2}


def test_lag_alert_fires_and_a_pause_alert_stops_consuming_until_it_resolves(make_config, model_dir):
    """A dead-letter storm -> dlq_rate with action pause: the trainer fetches nothing (no step, no commit) until the
    rate falls, then trains and commits; records arriving while it is paused are lag it has not read ->
    consumer_lag (held incomplete groups, read but not committed, are not lag: the alert judges the position)."""
    cfg = trainer_config(make_config, model_dir, **{
        "trainer.max_steps": 5, "telemetry.lag_interval_s": 0.2, "telemetry.heartbeat_interval_s": 1.0,
        "alerts.consumer_lag.max_records": 3, "alerts.consumer_lag.for_s": 0.5,
        "alerts.dlq_rate.max_per_minute": 1.0, "alerts.dlq_rate.window_s": 6.0, "alerts.dlq_rate.action": "pause"})
    group = trainer_group(cfg)

    def fired(name: str, state: str = "firing") -> list:
        return [a for a in read_alerts(transport) if a.name == name and a.state == state]

    with running_trainer(cfg) as (transport, sink, trainer, thread, errors):
        scored_tp = (transport.names.scored, 0)
        polls, reporters = PollCount(trainer.source), trainer.telemetry.reporters
        send_samples(transport, sink, range(5), samples=(0,))  # 5 records, no group complete: nothing commits
        sent_at = time.time()
        # a lag measurement consumer_lag's for_s after the send: 5 records behind the commit, none behind the position
        wait_for(lambda: (reporters.lag.measured_at or 0.0) > sent_at + 0.5 and (
            reporters.lag.total, reporters.lag.position_total) == (5, 0), "the 5 records read, measured for_s on", 30)
        assert not fired("consumer_lag")  # read, held in incomplete groups: not behind
        for i in range(3):  # undecodable: dead-lettered by the trainer
            sink.send_raw(transport.names.scored, b"\xc1not msgpack", key=f"bad{i}")
        sink.flush()
        wait_for(lambda: fired("dlq_rate"), "dlq_rate firing", 30)
        assert trainer.telemetry.paused
        before = committed(transport, group)
        send_samples(transport, sink, range(5), samples=(1,))  # completes all 5 groups, but the trainer is paused
        paused_before = polls.paused
        wait_for(lambda: polls.paused >= paused_before + 5, "5 polls while paused after the groups completed", 30)
        assert rows(cfg) == [] and committed(transport, group) == before  # nothing fetched, trained or committed
        wait_for(lambda: fired("consumer_lag"), "consumer_lag firing while paused", 30)
        wait_for(lambda: fired("dlq_rate", "resolved"), "dlq_rate resolved", 40)
        thread.join(90)  # resumed: trains the 5 groups (max_steps 5) and stops
        assert not thread.is_alive(), "the trainer did not resume after the pause alert resolved"

    assert errors == []
    assert len(rows(cfg)) == 5
    assert committed(transport, group) == {scored_tp: 13}  # 5 + 3 dead letters + 5
    lag = fired("consumer_lag")[0]
    assert lag.action == "log" and lag.value >= 5 and lag.threshold == 3
    assert before.get(scored_tp, 0) == 0
    beats = heartbeats(transport, trainer.telemetry.instance_id)
    assert any(b.state == "paused" and "dlq_rate" in b.open_alerts for b in beats)
