"""A reader that is not this project decodes our topics: raw record bytes fetched from the real broker by a bare
kafka-python consumer (not the project's edge), framed as kcat's ``-f '%R%s'`` frames them, and decoded by
ops/wire_reader.py, which imports only msgpack and follows docs/wire-format.md.

kcat itself (Debian's 1.7.1, librdkafka 2.0.2) cannot talk to the local tansu 0.6.0 broker: its ApiVersions v3
response underflows librdkafka's parser (measured here; ``api.version.request=false`` does not help). Against
Apache Kafka the documented command is
``kcat -C -b HOST:9092 -t TOPIC -e -q -f '%R%s' | python3 ops/wire_reader.py``.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from kafka import KafkaConsumer, TopicPartition
from support import messages as samples
from support.paths import REPO_ROOT

from stream_rl.transport.client import Transport

pytestmark = pytest.mark.broker
READER = REPO_ROOT / "ops" / "wire_reader.py"


def _raw_values(bootstrap: str, topic: str, count: int) -> list[bytes]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek(tp, 0)
    values: list[bytes] = []
    for _ in range(50):
        values.extend(r.value for r in consumer.poll(timeout_ms=300).get(tp, []))
        if len(values) >= count:
            break
    consumer.close()
    return values


def test_an_independent_msgpack_decoder_reads_our_records(make_config):
    t = Transport(make_config(**{"topics.partitions": {"rollouts": 1}}), "test")
    t.ensure_topics()
    sink = t.sink()
    sent = [samples.rollout(7, 0), samples.scored(7, 1)]
    for msg in sent:
        sink.send(t.names.rollouts, msg, key=msg.group_id)
    sink.flush()
    values = _raw_values(t.bootstrap, t.names.rollouts, len(sent))
    framed = b"".join(struct.pack(">i", len(v)) + v for v in values)
    # -I: isolated mode, no user site or PYTHONPATH; the script imports msgpack and the standard library only
    decoded = subprocess.run([sys.executable, "-I", str(READER)], input=framed, capture_output=True, timeout=60,
                             check=True)
    rows = [json.loads(line) for line in decoded.stdout.decode().splitlines()]
    assert [r["kind"] for r in rows] == ["rollout", "scored_rollout"]
    rollout = rows[0]
    assert rollout["rollout_id"] == sent[0].rollout_id and rollout["schema_version"] == 1
    assert rollout["response_token_ids"] == sent[0].response_token_ids.tolist()
    np.testing.assert_array_equal(np.asarray(rollout["behavior_logprobs"], dtype=np.float32),
                                  sent[0].behavior_logprobs)
    assert rollout["token_policy_versions"] == sent[0].token_policy_versions.tolist()
    assert rows[1]["rollout"]["rollout_id"] == sent[1].rollout.rollout_id
    assert rows[1]["reward"] == sent[1].reward
    assert "stream_rl" not in READER.read_text() and "schemas" not in READER.read_text().split('"""')[-1]
