"""Topic retention: ``topics.retention_ms`` becomes each topic's ``retention.ms`` at creation (real local broker).

tansu 0.6.0 stores and reports the config but does not delete expired records (measured), so these tests check
what the broker reports back, not deletion."""

from __future__ import annotations


from stream_rl.config.sections import DEFAULT_RETENTION_MS
from stream_rl.transport.client import Transport
from stream_rl.transport.topics import LOGICAL_TOPICS, describe_retention


def test_retention_is_applied_at_creation(make_config):
    cfg = make_config(**{"topics.retention_ms": {**DEFAULT_RETENTION_MS, "status": 60_000, "dlq": -1}})
    transport = Transport(cfg, "test")
    chunk_topic = transport.names.weights_chunks(7)
    created = transport.ensure_topics(extra={chunk_topic: 1})
    admin = transport.admin()
    try:
        got = describe_retention(admin, sorted(created))
    finally:
        admin.close()
    names = transport.names
    assert got[names.status] == 60_000
    assert got[names.dlq] == -1
    assert got[names.scored] == DEFAULT_RETENTION_MS["scored"]
    assert got[chunk_topic] == DEFAULT_RETENTION_MS["weights_chunks"]
    assert all(got[names.name(t)] == cfg.topics.retention_ms[t] for t in LOGICAL_TOPICS)


def test_existing_topic_keeps_its_retention(make_config):
    first = make_config(**{"topics.retention_ms": {"status": 60_000}})
    Transport(first, "test").ensure_topics()
    second = make_config(**{"topics.retention_ms": {"status": 120_000}})
    transport = Transport(second, "test")
    transport.ensure_topics()  # idempotent: no error, no change
    admin = transport.admin()
    try:
        got = describe_retention(admin, [transport.names.status, transport.names.scored])
    finally:
        admin.close()
    assert got == {transport.names.status: 60_000, transport.names.scored: None}
