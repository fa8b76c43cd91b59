"""Trainer storm-test helpers shared by the bus tier (tests/unit) and the broker tier (tests/integration): the
storm config (one group per step), scored records sent to the scored topic, and a two-member group."""

from __future__ import annotations

from support.trainer import scored


def storm_config(make_config, model_dir, **extra):
    base = {"trainer.model_dir": str(model_dir), "trainer.groups_per_step": 1, "trainer.micro_batch_size": 2,
            "trainer.poll_timeout_s": 0.2, "trainer.lr": 1e-3, "topics.partitions.scored": 1}
    base.update(extra)
    return make_config(**base)


def send(transport, sink, records) -> None:
    for r in records:
        sink.send(transport.names.scored, r, key=r.group_id)
    sink.flush()


def group(p: int, version: int = 0, **kw) -> list:
    return [scored(p, s, version=version, reward=float(s == 0), response_ids=[6 + s, 7], **kw) for s in range(2)]
