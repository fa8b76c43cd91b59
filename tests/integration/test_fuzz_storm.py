"""The fuzz storm: thousands of malformed records of every kind, interleaved with valid ones, written by an outside
client into the two topics the scorer and the trainer read, while both run as separate processes.

Malformed kinds (each variant checked in this process first: it must fail ``schemas.decode``, or be one the roles
reject against their models): bytes that are not msgpack, truncated and padded records, msgpack that is not a
map, a wrong or missing envelope, every top-level and nested field dropped or replaced by a value of the wrong
type, a null value, a record over 1 MiB, token ids outside the vocabulary and responses longer than the context.

At the end: every malformed record's coordinates are in exactly one dead letter with a non-empty reason, every valid
rollout was scored, every valid group was trained, the scorer is still running and the trainer reached its step
budget and exited 0.
"""

from __future__ import annotations

import random
from collections import Counter

import msgpack
import pytest
from kafka import KafkaProducer
from support.harness import Pipeline, role_overrides, tiny_policy_dir, trained_ids
from support.trainer import scored as make_scored

from schemas import Rollout, SchemaError, ScoredRollout, decode, encode, rollout_id_for

pytestmark = [pytest.mark.slow, pytest.mark.broker]

VALID_GROUPS, GROUP_SIZE, GROUPS_PER_STEP = 8, 4, 4
WRONG_VALUES = (None, 7, -1, 2 ** 64 - 1, 1.5, float("nan"), "x", b"\x00", [1, "a"], {"k": 1}, True)
SEED = 5


def _valid_rollout(i: int, sample: int) -> Rollout:
    return make_scored(i, sample, group_size=GROUP_SIZE, prompt_ids=(3, 4, 5), response_ids=(6, 7, 8)).rollout


def _valid_scored(i: int, sample: int) -> ScoredRollout:
    return make_scored(i, sample, group_size=GROUP_SIZE, prompt_ids=(3, 4, 5), response_ids=(6, 7, 8),
                       reward=float(sample % 2))


def _rewrite(raw: dict, path: tuple[str, ...], value) -> bytes:
    out = msgpack.unpackb(msgpack.packb(raw, use_bin_type=True), raw=False)  # a deep copy
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is _DROP:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return msgpack.packb(out, use_bin_type=True, strict_types=False)


_DROP = object()


def _field_variants(good: bytes) -> list[bytes]:
    """Every top-level field, and every field of a nested map, dropped or replaced by each wrong value."""
    raw = msgpack.unpackb(good, raw=False)
    paths = [(k,) for k in raw] + [(k, n) for k, v in raw.items() if isinstance(v, dict) for n in v]
    return [_rewrite(raw, path, value) for path in paths for value in (_DROP, *WRONG_VALUES)]


def _root_variants(good: bytes, rng: random.Random) -> list[bytes]:
    garbage = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(400)]
    cut = [good[: rng.randrange(1, len(good) - 1)] for _ in range(400)]
    return [b"", b"\xc1", good + b"\x00", msgpack.packb([1, 2]), msgpack.packb(3), msgpack.packb("str"),
            msgpack.packb(None), *garbage, *cut]


def _malformed(good: bytes, kind: str, rng: random.Random) -> list[bytes]:
    """Variants of ``good`` that ``schemas.decode`` rejects (variants that happen to decode are left out)."""
    out = []
    for data in _field_variants(good) + _root_variants(good, rng):
        try:
            decode(data, kind)
        except SchemaError:
            out.append(data)
    return out


def _unusable(vocab: int, context: int) -> list[ScoredRollout]:
    """Schema-valid scored rollouts the roles must refuse against their models (each its own group)."""
    out = []
    for k in range(20):
        out.append(make_scored(1000 + k, 0, group_size=GROUP_SIZE, response_ids=(6, vocab + k)))  # not a token
        out.append(make_scored(2000 + k, 0, group_size=GROUP_SIZE, response_ids=tuple([6] * (context + k))))
    return out


class OutsideWriter:
    """An outside client: kafka-python with its own settings (max_request_size 4 MiB, murmur2 by default)."""

    def __init__(self, bootstrap: str):
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=4 << 20)
        self.futures: list[tuple[bool, object]] = []

    def send(self, topic: str, value: bytes | None, key: str, malformed: bool) -> None:
        self.futures.append((malformed, self.producer.send(topic, value=value, key=key.encode())))

    def coordinates(self) -> tuple[set, set]:
        self.producer.flush()
        bad, good = set(), set()
        for malformed, future in self.futures:
            meta = future.get(timeout=60)
            (bad if malformed else good).add((meta.topic, meta.partition, meta.offset))
        self.producer.close()
        return bad, good


def _interleave(valid: list, malformed: list, rng: random.Random) -> list:
    """``malformed`` with ``valid`` spread through it at random places, valid items in their own order."""
    slots = set(rng.sample(range(len(valid) + len(malformed)), len(valid)))
    valid_it, bad_it = iter(valid), iter(malformed)
    return [next(valid_it) if i in slots else next(bad_it) for i in range(len(valid) + len(malformed))]


def _readable(records, kind: str) -> list:
    """The records of a topic this storm also wrote garbage to that decode as ``kind``."""
    out = []
    for _, _, value in records:
        try:
            out.append(decode(value, kind))
        except SchemaError:
            continue
    return out


@pytest.mark.timeout(900)
def test_thousands_of_malformed_records_are_dead_lettered_and_everything_valid_is_processed(make_config,
                                                                                         tmp_path):
    rng = random.Random(SEED)
    model_dir = tiny_policy_dir(tmp_path / "policy")
    steps = 2 * VALID_GROUPS // GROUPS_PER_STEP
    cfg = make_config(**role_overrides(model_dir, **{
        "trainer.max_steps": steps, "trainer.groups_per_step": GROUPS_PER_STEP, "trainer.max_lag": 1000,
        "trainer.checkpoint_every": 1000, "scorer.reference_model_dir": str(model_dir)}))
    from transformers import AutoConfig

    model_cfg = AutoConfig.from_pretrained(model_dir)
    rollout_bad = _malformed(encode(_valid_rollout(0, 0)), "rollout", rng)
    scored_bad = _malformed(encode(_valid_scored(0, 0)), "scored_rollout", rng)
    unusable = _unusable(model_cfg.vocab_size, model_cfg.max_position_embeddings)
    valid_rollouts = [_valid_rollout(i, s) for i in range(VALID_GROUPS) for s in range(GROUP_SIZE)]
    valid_scored = [_valid_scored(100 + i, s) for i in range(VALID_GROUPS) for s in range(GROUP_SIZE)]
    big = b"\x81\xa4kind\xa7rollout" + b"\x00" * (3 << 19)  # 1.5 MB, not a valid record
    with Pipeline(cfg) as pipe:
        names = pipe.names
        writer = OutsideWriter(pipe.transport.bootstrap)
        plan = [*[(names.rollouts, v, "g", True) for v in rollout_bad], (names.rollouts, None, "null", True),
                (names.rollouts, big, "big", True), *[(names.scored, v, "g", True) for v in scored_bad],
                (names.scored, None, "null", True), (names.scored, big, "big", True),
                *[(names.rollouts, encode(u.rollout), u.group_id, True) for u in unusable],
                *[(names.scored, encode(u), u.group_id, True) for u in unusable]]
        rng.shuffle(plan)
        valid = [*[(names.rollouts, encode(r), r.group_id, False) for r in valid_rollouts],
                 *[(names.scored, encode(s), s.group_id, False) for s in valid_scored]]
        for topic, value, key, malformed in _interleave(valid, plan, rng):
            writer.send(topic, value, key, malformed)
        bad, good = writer.coordinates()
        assert len(bad) >= 2000, f"only {len(bad)} malformed records: the storm is too small"
        kinds = Counter(t for t, _, _ in bad)
        scorer, trainer = pipe.start("score", 0), pipe.start("train", 0)
        pipe.wait_until(lambda: pipe.finished(trainer), f"the trainer to reach step {steps}", 600,
                        may_exit=[trainer])
        dead = pipe.read("dlq", "dead_letter")
        assert scorer.proc.poll() is None, "the scorer exited"
        lines = pipe.trained()
        scored_ids = {m.rollout.rollout_id for m in _readable(pipe.read("scored", None), "scored_rollout")}

    letters = Counter((m.source_topic, m.source_partition, m.source_offset) for _, _, m in dead if m.reason.strip())
    missing = bad - set(letters)
    assert not missing, f"{len(missing)} of {len(bad)} malformed records never reached the dead-letter topic"
    twice = [c for c in bad if letters[c] > 1]
    assert not twice, f"{len(twice)} malformed records dead-lettered more than once"
    assert not (good & set(letters)), "a valid record was dead-lettered"
    assert {r.rollout_id for r in valid_rollouts} <= scored_ids, "a valid rollout was not scored"
    trained = set(trained_ids(lines))
    expected = {rollout_id_for(f"p{i}", 0, s) for i in [*range(VALID_GROUPS), *range(100, 100 + VALID_GROUPS)]
                for s in range(GROUP_SIZE)}
    assert expected <= trained, f"valid rollouts not trained: {sorted(expected - trained)[:8]}"
    print(f"{len(bad)} malformed records ({dict(kinds)}), {len(good)} valid; {len(letters)} dead letters")
