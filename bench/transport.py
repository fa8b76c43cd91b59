"""Benchmark 1, transport capacity: scored rollouts of 1,024 response tokens through the project's edge, against raw
kafka-python records of the same bytes on the same broker, in the same run.

What is measured (variants interleaved round by round, median of >= 3 rounds)::

    project produce: schemas.encode (validate + msgpack) ─ Sink.send (trace span, traceparent header) ─ flush (acks)
    raw produce:     KafkaProducer.send(same encoded bytes, same key, same client settings) ─ flush, futures checked
    project consume: Source.poll (fetch, decode, validate every field, DLQ on error) ─ Source.commit per batch
    raw consume:     KafkaConsumer.poll (fetch only) ─ commit per batch, same group settings

    codec alone:     encode + decode of one rollout (µs), and each alone,  vs  msgpack.packb/unpackb of the same
                     content with the arrays as raw bytes (tobytes / np.frombuffer), no schema, no validation
    CPU per record:  time.process_time() of this process (every thread: kafka-python's I/O threads too) over
                     each project and raw round, per record: what the interpreter spent, beside the wall time
    durable:         the project's produce and consume again, on a second local broker with durable storage
                     (tansu s3:// on SeaweedFS, what `stream-rl run` uses by default), interleaved with the rest

Each produce round sends N records to a 4-partition topic and flushes; the consume round then drains exactly those N
records (consumers joined their groups before any timing starts). The capacity of a path is min(produce, consume)
rollouts/s, because producers, scorers and the trainer are separate processes: the slower side bounds the stream.
Both paths use the project's client settings (acks=all, idempotence, linger 5 ms, 1 MiB request limit), so the
ratio isolates what the codec and the edge add on top of kafka-python itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from bench.common import MB, BenchContext, fmt, interleave, md_table, medians
from stream_rl import broker
from stream_rl.config.sections import BrokerConfig

TITLE = "Transport capacity"
RESPONSE_TOKENS = 1024
PROMPT_TOKENS = 128
POOL = 256
PARTITIONS = 4
JOIN_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 120.0
_ARRAYS = ("prompt_token_ids", "response_token_ids", "behavior_logprobs", "token_policy_versions")


def make_rollouts(count: int, seed: int = 0) -> list[Any]:
    """``count`` valid ScoredRollouts with 1,024 response tokens (ids, behaviour log-probs, versions, reference
    log-probs), a 128-token prompt and texts of about 4 characters per token, in groups of 8."""
    from schemas import Rollout, ScoredRollout, group_id_for, rollout_id_for

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        prompt_id, sample = f"bench-{i // 8}", i % 8
        versions = np.full(RESPONSE_TOKENS, 7, dtype=np.int64)
        versions[: RESPONSE_TOKENS // 3] = 6  # a weight update landed during generation
        rollout = Rollout(
            rollout_id=rollout_id_for(prompt_id, 0, sample), prompt_id=prompt_id, epoch=0,
            group_id=group_id_for(prompt_id, 0), sample_index=sample, group_size=8,
            prompt_token_ids=rng.integers(0, 32_000, PROMPT_TOKENS, dtype=np.int32),
            response_token_ids=rng.integers(0, 32_000, RESPONSE_TOKENS, dtype=np.int32),
            behavior_logprobs=-rng.exponential(1.0, RESPONSE_TOKENS).astype(np.float32),
            token_policy_versions=versions, finish_reason="length", producer_id="producer-0",
            prompt_text="What is 6 times 7? " * (PROMPT_TOKENS // 4), response_text="tok " * RESPONSE_TOKENS,
            answer="42", metadata={"task": "bench"}, temperature=1.0, timings={"generate_s": 1.5})
        out.append(ScoredRollout(
            rollout=rollout, reward=1.0, reward_components={"correct": 1.0},
            ref_logprobs=-rng.exponential(1.0, RESPONSE_TOKENS).astype(np.float32), scorer_id="scorer-0",
            timings={"score_s": 0.01}))
    return out


# ---------------------------------------------------------------- codec alone


def plain_pack(msg: Any) -> bytes:
    """The baseline encoding: the same content as a flat msgpack map, arrays as raw bytes, nothing checked."""
    r = msg.rollout
    fields = {name: getattr(r, name).tobytes() for name in _ARRAYS}
    fields["ref_logprobs"] = msg.ref_logprobs.tobytes()
    fields.update(rollout_id=r.rollout_id, prompt_id=r.prompt_id, epoch=r.epoch, group_id=r.group_id,
                  sample_index=r.sample_index, group_size=r.group_size, finish_reason=r.finish_reason,
                  producer_id=r.producer_id, prompt_text=r.prompt_text, response_text=r.response_text,
                  answer=r.answer, metadata=r.metadata, temperature=r.temperature, timings=r.timings,
                  reward=msg.reward, reward_components=msg.reward_components, scorer_id=msg.scorer_id)
    return msgpack.packb(fields, use_bin_type=True)


_PLAIN_DTYPES = {"prompt_token_ids": np.int32, "response_token_ids": np.int32, "behavior_logprobs": np.float32,
                 "token_policy_versions": np.int64, "ref_logprobs": np.float32}


def plain_unpack(data: bytes) -> dict[str, Any]:
    fields = msgpack.unpackb(data, raw=False)
    for name, dtype in _PLAIN_DTYPES.items():
        fields[name] = np.frombuffer(fields[name], dtype=dtype)
    return fields


def _codec_steps(msgs: Sequence[Any], count: int) -> list[tuple[str, Any]]:
    from schemas import decode, encode

    values = [encode(m) for m in msgs]

    def timed(name: str, one) -> Any:
        def step() -> dict[str, float]:
            start = time.perf_counter()
            for i in range(count):
                one(i % len(msgs))
            return {name: (time.perf_counter() - start) / count * 1e6}
        return step

    return [("codec", timed("codec_us", lambda i: decode(encode(msgs[i]), "scored_rollout"))),
            ("encode", timed("encode_us", lambda i: encode(msgs[i]))),
            ("decode", timed("decode_us", lambda i: decode(values[i], "scored_rollout"))),
            ("plain msgpack", timed("plain_msgpack_us", lambda i: plain_unpack(plain_pack(msgs[i]))))]


# ---------------------------------------------------------------- through the broker


class _Paths:
    """The project's Sink/Source and a raw producer/consumer pair, each on its own 4-partition topic."""

    def __init__(self, ctx: BenchContext, msgs: Sequence[Any]):
        from kafka import KafkaConsumer, KafkaProducer

        from schemas import encode
        from stream_rl.transport.client import Transport
        from stream_rl.transport.settings import consumer_settings, producer_settings

        self.msgs = msgs
        self.values = [encode(m) for m in msgs]
        self.keys = [m.group_id.encode() for m in msgs]
        cfg = ctx.config("bench-transport")  # the scored topic has 4 partitions by default
        self.transport = Transport(cfg, "bench-transport")
        names = self.transport.names
        self.topic, self.raw_topic = names.scored, names.name("raw")
        self.transport.ensure_topics(extra={self.raw_topic: PARTITIONS})
        self.sink = self.transport.sink()
        self.source = self.transport.source([self.topic], f"{names.run}-scored", "scored_rollout", self.sink)
        boot, kafka_cfg = self.transport.bootstrap, cfg.kafka
        self.producer = KafkaProducer(**producer_settings(kafka_cfg, boot, "bench-raw-producer"))
        self.consumer = KafkaConsumer(**consumer_settings(kafka_cfg, boot, f"{names.run}-raw", "bench-raw"))
        self.consumer.subscribe([self.raw_topic])
        _join(lambda: self.source.poll(timeout_s=0.2), self.source)
        _join(lambda: self.consumer.poll(timeout_ms=200), self.consumer)

    def steps(self, count: int) -> list[tuple[str, Any]]:
        return [("project produce", _with_cpu("project_produce", lambda: self._produce_project(count))),
                ("project consume", _with_cpu("project_consume", lambda: self._consume_project(count))),
                ("raw produce", _with_cpu("raw_produce", lambda: self._produce_raw(count))),
                ("raw consume", _with_cpu("raw_consume", lambda: self._consume_raw(count)))]

    def _produce_project(self, count: int) -> float:
        start = time.perf_counter()
        for i in range(count):
            msg = self.msgs[i % len(self.msgs)]
            self.sink.send(self.topic, msg, key=msg.group_id)
        self.sink.flush()
        return time.perf_counter() - start

    def _produce_raw(self, count: int) -> float:
        start = time.perf_counter()
        futures = [self.producer.send(self.raw_topic, value=self.values[i % len(self.values)],
                                      key=self.keys[i % len(self.keys)]) for i in range(count)]
        self.producer.flush()
        for future in futures:
            future.get(timeout=60)
        return time.perf_counter() - start

    def _consume_project(self, count: int) -> float:
        got, start = 0, time.perf_counter()
        while got < count:
            got += len(self.source.poll(timeout_s=0.5))
            self.source.commit()
            _check_deadline(start, got, count)
        if got != count or self.source.dead_lettered:
            raise RuntimeError(f"project consumer read {got} of {count} ({self.source.dead_lettered} dead letters)")
        return time.perf_counter() - start

    def _consume_raw(self, count: int) -> float:
        got, start = 0, time.perf_counter()
        while got < count:
            got += sum(len(records) for records in self.consumer.poll(timeout_ms=500).values())
            self.consumer.commit()
            _check_deadline(start, got, count)
        if got != count:
            raise RuntimeError(f"raw consumer read {got} of {count}")
        return time.perf_counter() - start

    def close(self) -> None:
        self.source.close()
        self.consumer.close(autocommit=False)
        self.producer.close(timeout=10)
        self.sink.close()
        with self.transport.admin() as admin:  # the memory-store broker frees a deleted topic's records
            admin.delete_topics([self.topic, self.raw_topic])
        self.transport.tracing.shutdown()


def _with_cpu(name: str, timed) -> Any:
    """A step reporting ``{name}_s`` (the wall time ``timed`` measured itself) and ``{name}_cpu_s`` (CPU time of
    this whole process meanwhile, every thread included)."""
    def step() -> dict[str, float]:
        cpu = time.process_time()
        wall = timed()
        return {f"{name}_s": wall, f"{name}_cpu_s": time.process_time() - cpu}
    return step


def _join(poll, consumer) -> None:
    """Poll an empty topic until the group assigned every partition (a join takes ~3 s on tansu)."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while len(consumer.assignment()) < PARTITIONS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"consumer group not assigned {PARTITIONS} partitions within {JOIN_TIMEOUT_S}s")
        if poll():
            raise RuntimeError("a benchmark topic was not empty before the first round")


def _check_deadline(start: float, got: int, count: int) -> None:
    if time.perf_counter() - start > DRAIN_TIMEOUT_S:
        raise TimeoutError(f"drained only {got} of {count} records in {DRAIN_TIMEOUT_S}s")


def run(ctx: BenchContext) -> dict[str, Any]:
    """Codec rounds, then produce/consume rounds of the project's path and the raw path, interleaved."""
    records = ctx.pick(full=4000, quick=600, tiny=40)
    codec_count = ctx.pick(full=3000, quick=500, tiny=30)
    msgs = make_rollouts(POOL if ctx.mode != "tiny" else 16)
    ctx.log(f"transport: codec, {codec_count} rollouts per round")
    samples = interleave(_codec_steps(msgs, codec_count), ctx.repeats, ctx.log)
    durable_cfg = BrokerConfig(state_dir=ctx.workdir / "durable-broker", storage="durable")
    durable_ctx = dataclasses.replace(ctx, bootstrap=broker.up(durable_cfg).bootstrap)
    paths = durable = None
    try:
        paths, durable = _Paths(ctx, msgs), _Paths(durable_ctx, msgs)
        ctx.log(f"transport: broker (memory and durable storage), {records} rollouts per round")
        steps = paths.steps(records) + [
            ("durable produce", lambda: {"durable_produce_s": durable._produce_project(records)}),
            ("durable consume", lambda: {"durable_consume_s": durable._consume_project(records)})]
        samples.update(interleave(steps, ctx.repeats, ctx.log))
        record_bytes = sum(map(len, paths.values)) / len(paths.values)
    finally:
        for opened in (paths, durable):
            if opened is not None:
                opened.close()
        broker.down(durable_cfg)
    plain_bytes = sum(len(plain_pack(m)) for m in msgs) / len(msgs)
    figures = _figures(medians(samples), records, record_bytes)
    figures["plain_msgpack_bytes"] = plain_bytes
    return {"figures": figures, "samples": samples, "notes": [],
            "params": {"records_per_round": records, "codec_rollouts_per_round": codec_count,
                       "response_tokens": RESPONSE_TOKENS, "prompt_tokens": PROMPT_TOKENS, "partitions": PARTITIONS,
                       "distinct_rollouts": len(msgs), "repeats": ctx.repeats,
                       "batch_size": _batch_size(ctx.config("bench-transport").kafka)}}


def _batch_size(kafka_cfg: Any) -> int:
    from stream_rl.transport.settings import producer_settings

    return producer_settings(kafka_cfg, "unused:0")["batch_size"]


def _figures(med: Mapping[str, float], records: int, record_bytes: float) -> dict[str, float]:
    figures = {"record_bytes": record_bytes, "codec_ratio": med["codec_us"] / med["plain_msgpack_us"],
               **{name: med[name] for name in ("codec_us", "encode_us", "decode_us", "plain_msgpack_us")}}
    for path in ("project", "raw"):
        for phase in ("produce", "consume"):
            figures[f"{path}_{phase}_cpu_us"] = med[f"{path}_{phase}_cpu_s"] / records * 1e6
    for path in ("project", "raw", "durable"):
        for phase in ("produce", "consume"):
            rate = records / med[f"{path}_{phase}_s"]
            figures[f"{path}_{phase}_rollouts_s"] = rate
            figures[f"{path}_{phase}_mb_s"] = rate * record_bytes / MB
        capacity = min(figures[f"{path}_produce_rollouts_s"], figures[f"{path}_consume_rollouts_s"])
        figures[f"{path}_capacity_rollouts_s"] = capacity
        figures[f"{path}_capacity_mb_s"] = capacity * record_bytes / MB
    for name in ("produce", "consume", "capacity"):
        figures[f"{name}_ratio"] = figures[f"project_{name}_rollouts_s"] / figures[f"raw_{name}_rollouts_s"]
    for name in ("produce", "consume", "capacity"):
        figures[f"durable_{name}_ratio"] = (figures[f"durable_{name}_rollouts_s"]
                                            / figures[f"project_{name}_rollouts_s"])
    figures["project_capacity_tokens_s"] = figures["project_capacity_rollouts_s"] * RESPONSE_TOKENS
    return figures


# ---------------------------------------------------------------- report


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    f = result["figures"]
    headers = ["", "project (codec + Sink/Source)", "raw kafka-python, same bytes", "project ÷ raw"]
    rows = []
    for phase, what in (("produce", "produce: encode + send + acks"), ("consume", "consume: fetch + decode + "
                        "validate + commit"), ("capacity", "capacity = min(produce, consume)")):
        rows.append([what, f"{fmt(f[f'project_{phase}_rollouts_s'])} rollouts/s · "
                     f"{fmt(f[f'project_{phase}_mb_s'])} MB/s",
                     f"{fmt(f[f'raw_{phase}_rollouts_s'])} rollouts/s · {fmt(f[f'raw_{phase}_mb_s'])} MB/s",
                     f"**{fmt(f[f'{phase}_ratio'])}×**"])
    rows.append(["codec alone: encode + decode, µs per rollout", fmt(f["codec_us"]),
                 f"{fmt(f['plain_msgpack_us'])} (plain msgpack, arrays as bytes)",
                 f"**{fmt(f['codec_ratio'])}×** (cost)"])
    rows.append(["codec alone, each side: encode (validate + pack) · decode (unpack + validate), µs",
                 f"{fmt(f['encode_us'])} · {fmt(f['decode_us'])}", "", ""])
    for phase in ("produce", "consume"):
        rows.append([f"CPU of this process per record, {phase} (µs, every thread)",
                     fmt(f[f"project_{phase}_cpu_us"]), fmt(f[f"raw_{phase}_cpu_us"]),
                     f"+{fmt(f[f'project_{phase}_cpu_us'] - f[f'raw_{phase}_cpu_us'])} µs"])
    for phase in ("produce", "consume", "capacity"):
        rows.append([f"durable storage, {phase} (project path)", f"{fmt(f[f'durable_{phase}_rollouts_s'])} "
                     f"rollouts/s · {fmt(f[f'durable_{phase}_mb_s'])} MB/s", "",
                     f"**{fmt(f[f'durable_{phase}_ratio'])}×** of memory storage"])
    rows.append(["record size, bytes", fmt(f["record_bytes"]), f"{fmt(f['record_bytes'])} "
                 f"(plain msgpack map: {fmt(f['plain_msgpack_bytes'])})", ""])
    return headers, rows


def headline(result: Mapping[str, Any]) -> str:
    f = result["figures"]
    return (f"{fmt(f['project_capacity_rollouts_s'])} rollouts/s of 1,024 tokens "
            f"({fmt(f['project_capacity_tokens_s'])} tokens/s), {fmt(f['capacity_ratio'])}× raw kafka-python")


GOAL_RATIO, GOAL_ROLLOUTS_S = 0.95, 2000
"""Issue 14's goals: a capacity of at least 2,000 rollouts/s, and at least 0.95x raw kafka-python's."""


def _extra_us(f: Mapping[str, float], phase: str) -> float:
    """Wall time per record beyond raw's: ``1e6 / project rate - 1e6 / raw rate`` (negative: less)."""
    return 1e6 / f[f"project_{phase}_rollouts_s"] - 1e6 / f[f"raw_{phase}_rollouts_s"]


def more_tables(result: Mapping[str, Any]) -> str:
    """The goals against this run, and the wall time per record the project adds to raw's against the budget the
    ratio goal leaves (``(1 - 0.95) * 1e6 / raw rate`` µs)."""
    f = result["figures"]

    def verdict(ok: bool) -> str:
        return "reached" if ok else "not reached"

    rows = [[f"capacity ≥ {fmt(GOAL_ROLLOUTS_S)} rollouts/s", fmt(f["project_capacity_rollouts_s"]),
             verdict(f["project_capacity_rollouts_s"] >= GOAL_ROLLOUTS_S)],
            [f"capacity ≥ {GOAL_RATIO}× raw", f"{fmt(f['capacity_ratio'])}×",
             verdict(f["capacity_ratio"] >= GOAL_RATIO)]]
    rows += [[f"{phase}: wall time per record beyond raw · budget at {GOAL_RATIO}× raw",
              f"{_extra_us(f, phase):+.3g} µs · {fmt((1 - GOAL_RATIO) * 1e6 / f[f'raw_{phase}_rollouts_s'])} µs",
              f"{fmt(f[f'{phase}_ratio'])}× raw"] for phase in ("produce", "consume")]
    batch = result.get("params", {}).get("batch_size")
    if batch:
        rows.append(["`kafka.batch_size` (both paths)", f"{fmt(batch / 1024)} KiB per partition", ""])
    return md_table(["goal or cost", "this run", ""], rows)
