"""Trainer defect 17.6 of the kill -9 / fuzz storm, on the real broker: a trainer-group member stopped during its
first join leaves tansu's group unjoinable; the trainer, which assigns its partitions, trains at once. The storm's
other trainer defects (17.1, 17.2, 17.4, 17.9, issue 12) run through the loop on the in-process bus:
tests/unit/test_trainer_loop_storm.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.topics import committed
from support.storm import group, send, storm_config
from support.trainer_loop import finish, start

from consumers.trainer.trainer import trainer_group
from stream_rl.storage.checkpoint import latest_checkpoint, load_checkpoint
from stream_rl.transport.client import Transport

torch.set_num_threads(1)


MEMBER = """
import signal, sys
from kafka import KafkaConsumer
bootstrap, topic, group, session, heartbeat = sys.argv[1:6]
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))  # as every role does: a clean close on SIGTERM
c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                  session_timeout_ms=int(session), heartbeat_interval_ms=int(heartbeat))
c.subscribe([topic])
print("joining", flush=True)
while not stop:
    c.poll(200)
c.close(autocommit=False)
"""


@pytest.mark.broker
def test_a_member_stopped_during_its_first_join_does_not_stall_the_trainer(make_config, model_dir):
    """17.6: a trainer-group member SIGTERMed during its first join leaves the group unjoinable on tansu 0.6 (a
    subscriber gets no partition for minutes); the trainer assigns its partitions and trains at once."""
    cfg = storm_config(make_config, model_dir, **{"trainer.max_steps": 1, "topics.partitions.scored": 2})
    transport = Transport(cfg, "test")
    transport.ensure_topics()
    sink = transport.sink()
    member = subprocess.Popen(
        [sys.executable, "-c", MEMBER, transport.bootstrap, transport.names.scored, trainer_group(cfg),
         str(cfg.kafka.session_timeout_ms), str(cfg.kafka.heartbeat_interval_ms)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert member.stdout.readline().strip() == "joining"
        time.sleep(0.5)  # inside the join, which tansu holds for session_timeout / 2
    finally:
        member.send_signal(signal.SIGTERM)
        member.wait(20)
    send(transport, sink, group(0))
    began = time.monotonic()
    state = finish(*start(cfg), timeout_s=25)  # a subscribing trainer would still be waiting for its partitions
    assert state.step == 1 and time.monotonic() - began < 25
    ckpt = load_checkpoint(latest_checkpoint(Path(cfg.run_dir) / "checkpoints"))
    assert committed(transport, trainer_group(cfg)) == ckpt.offsets  # commits work without group membership
    assert set(ckpt.offsets) == {(transport.names.scored, 0), (transport.names.scored, 1)}
    sink.close()
