"""Benchmark 6, scorer scale-out: scorer-bound throughput with 1 and 2 scorer processes in one consumer group.

Consumes: the demo (:func:`bench.demo_runs.demo_dir`): its policy generates a base set of real rollouts once (HF
engine, 32 prompts x 8 samples per batch, in this process); the demo's reward function, reward model (on, weight 1)
and reference model score them.
Produces: per round (variants interleaved, at least 3 rounds), for 1 and for 2 scorers:

1. a fresh run (topics, consumer group); the scorer processes start (Supervisor, as ``stream-rl run`` starts them,
   ``scorer.batch_size`` 256), each pinned to its own core (with one core usable, both share it);
2. warm-up: this process trickles copies of 256 base rollouts (epochs from ``WARMUP_EPOCH0``, left out of the
   measurement) until every scorer has scored some, so all have joined the group, loaded their models and run a
   first batch; then it pre-fills the rollouts topic with ``N`` copies of the base set under fresh ids (epoch =
   copy number, ids recomputed) at once, so the producers are "faster than the scorers" by construction (the
   send rate is recorded to show it), and waits, polling the scored topic's high-water marks every half second;
3. throughput from the scored records' own ``timings.created_at`` stamps (written by each scorer as it assembles
   a record): with ``first_s``/``last_s`` the first and last stamp of scorer ``s``, the window runs from the latest
   first stamp to the earliest last stamp, so every scorer is running during all of it, and the rate is the
   records stamped inside the window over its length. This leaves out start-up, the group join, the first batch
   and the tail where one scorer has finished its partitions.

On 2 usable cores the ideal ratio is at most 2; the broker shares those cores.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import demo_runs as dr
from bench.common import BenchContext, fmt, interleave, medians

TITLE = "Scorer scale-out"
SCORER_COUNTS = (1, 2)


def sizes(ctx: BenchContext) -> dict[str, int]:
    """Base rollouts generated (multiples of 256), rollouts pre-filled per measurement, deadline per drain."""
    return ctx.pick(full={"base": 1024, "rollouts": 4096, "deadline_s": 240},
                    quick={"base": 512, "rollouts": 3072, "deadline_s": 180},
                    tiny={"base": 256, "rollouts": 1536, "deadline_s": 180})


def base_rollouts(cfg, demo: Path, count: int) -> list:
    """``count`` real rollouts of the demo policy (whole groups of ``run.group_size``)."""
    from producers.engines import build_engine
    from producers.step import produce_rollouts

    per_batch = cfg.producer.prompts_per_batch
    prompts = dr.demo_prompts(demo, count // cfg.run.group_size, cfg.run.group_size)
    engine = build_engine(cfg.producer)
    try:
        with dr.one_thread():
            return [r for i in range(0, len(prompts), per_batch)
                    for r in produce_rollouts(prompts[i:i + per_batch], engine, producer_id="bench-producer",
                                              sampling=cfg.producer.sampling(),
                                              max_new_tokens=cfg.producer.max_new_tokens, seed=i).rollouts]
    finally:
        engine.close()


def copies(base: Sequence[Any], count: int, first_epoch: int = 0) -> list:
    """``count`` rollouts cycling through ``base``; copy ``c`` gets epoch ``first_epoch + c`` and the ids that go
    with it."""
    from schemas import group_id_for, rollout_id_for

    out = []
    for i in range(count):
        r, epoch = base[i % len(base)], first_epoch + i // len(base)
        out.append(dataclasses.replace(r, epoch=epoch, group_id=group_id_for(r.prompt_id, epoch),
                                       rollout_id=rollout_id_for(r.prompt_id, epoch, r.sample_index)))
    return out


def window_rate(stamps: Mapping[str, Sequence[float]]) -> tuple[float, int, float]:
    """(records/s, records, seconds) over the window where every scorer in ``stamps`` was producing.

    ``stamps`` maps a scorer id to the ``created_at`` of each record it scored."""
    if not stamps or any(len(v) < 2 for v in stamps.values()):
        raise ValueError(f"every scorer needs at least 2 scored records, got "
                         f"{ {k: len(v) for k, v in stamps.items()} }")
    start = max(min(v) for v in stamps.values())
    end = min(max(v) for v in stamps.values())
    inside = sum(1 for v in stamps.values() for t in v if start < t <= end)
    if end <= start or inside == 0:
        raise ValueError("the scorers' working windows do not overlap: too few rollouts for this many scorers")
    return inside / (end - start), inside, end - start


def run(ctx: BenchContext) -> dict[str, Any]:
    demo = dr.demo_dir(ctx)
    size = sizes(ctx)
    cfg0 = dr.demo_config(ctx, demo, "bench-scorers-base")
    ctx.log(f"scorers: generating {size['base']} base rollouts")
    base = base_rollouts(cfg0, demo, size["base"])
    rollouts = copies(base, size["rollouts"])
    details: list[dict[str, Any]] = []

    def variant(n: int):
        def measure() -> dict[str, float]:
            cfg = dr.demo_config(ctx, demo, f"bench-scorers{n}", **{
                "scorer.reward_model_weight": 1.0, "run.scorers": n})
            stamps, sent_s = _drain(ctx, cfg, n, base, rollouts, size["deadline_s"])
            rate, inside, seconds = window_rate(stamps)
            details.append({"scorers": n, "per_scorer": {k: len(v) for k, v in stamps.items()},
                            "window_records": inside, "window_s": seconds})
            return {f"scorers{n}_rollouts_s": rate, f"prefill{n}_rollouts_s": len(rollouts) / sent_s}
        return measure

    samples = interleave([(f"{n} scorer(s)", variant(n)) for n in SCORER_COUNTS], ctx.rounds, ctx.log, ctx.min_rounds)
    med = medians(samples)
    figures = {**med, "scale_out": med["scorers2_rollouts_s"] / med["scorers1_rollouts_s"],
               "prefill_vs_one_scorer": med["prefill1_rollouts_s"] / med["scorers1_rollouts_s"]}
    return {"figures": figures, "samples": samples,
            "notes": [f"Each measurement pre-fills {size['rollouts']} rollouts (copies of {size['base']} "
                      f"generated ones) and drains them; scorer batch {cfg0.scorer.batch_size}; cores "
                      f"{dr.usable_cores()}."],
            "params": {**size, "scorer_counts": list(SCORER_COUNTS), "batch_size": cfg0.scorer.batch_size,
                       "cores": dr.usable_cores(), "runs": details, "repeats": ctx.rounds}}


WARMUP_EPOCH0 = 1_000_000  # warm-up copies use epochs from here: never confused with the measured ones


def _send(sink, topic: str, rollouts: Sequence[Any]) -> float:
    """Send ``rollouts`` keyed by group id and wait for the acks; returns the seconds it took."""
    t0 = time.perf_counter()
    for rollout in rollouts:
        sink.send(topic, rollout, key=rollout.group_id)
    sink.flush()
    return time.perf_counter() - t0


def _drain(ctx: BenchContext, cfg, n: int, base: Sequence[Any], rollouts: Sequence[Any],
           deadline_s: float) -> tuple[dict[str, list[float]], float]:
    """Start ``n`` scorers (pinned); trickle warm-up copies of ``base`` until every scorer has scored some (all
    joined the group, models loaded, first batch done); then pre-fill ``rollouts`` at once and wait until they are
    scored. Returns the measured records' stamps by scorer, and the seconds the pre-fill took."""
    from stream_rl.launch.orchestrator import Supervisor, write_run_config
    from stream_rl.transport.client import Transport

    run_dir = Path(cfg.run_dir)
    transport = Transport(cfg, "bench")
    transport.ensure_topics()
    sink, topic = transport.sink(), transport.names.rollouts
    sup = Supervisor(run_dir, write_run_config(cfg, run_dir))
    cores = dr.usable_cores()
    reader = _ScoredReader(cfg)
    try:
        for i in range(n):
            dr.pin(sup.start("score", i).proc.pid, cores[i % len(cores)])
        started, sent, epoch = time.monotonic(), 0, WARMUP_EPOCH0
        while len(reader.scorers()) < n or reader.count() < sent:
            _check(sup, started, deadline_s, f"{n} scorer(s) did not all start scoring", run_dir)
            if reader.count() >= sent:  # the last warm-up batch is done: send another
                warm = copies(base[:256], min(len(base), 256), first_epoch=epoch)  # one copy: one epoch
                epoch += 1
                _send(sink, topic, warm)
                sent += len(warm)
            time.sleep(0.5)
        sent_s = _send(sink, topic, rollouts)
        expected = sent + len(rollouts)
        while reader.count() < expected:
            _check(sup, started, 2 * deadline_s, f"{n} scorer(s) scored {reader.count()} of {expected}", run_dir)
            time.sleep(0.5)
    finally:
        sup.stop_all()
        sink.close()
        transport.tracing.shutdown()
    try:
        return reader.stamps(below_epoch=WARMUP_EPOCH0), sent_s
    finally:
        reader.close()


def _check(sup, started: float, deadline_s: float, what: str, run_dir: Path) -> None:
    sup.check()
    if time.monotonic() - started > deadline_s:
        raise RuntimeError(f"{what} within {deadline_s:.0f} s\n{dr.log_tails(run_dir)}")


class _ScoredReader:
    """Group-less reads of the run's scored topic: the record count, then each record's scorer and stamp."""

    def __init__(self, cfg):
        from stream_rl.transport.client import Transport

        self.transport = Transport(cfg, "bench-reader")
        self.reader = self.transport.reader()
        self.tps = self.reader.partitions(self.transport.names.scored)

    def count(self) -> int:
        return sum(self.reader.highwaters(self.tps).values())

    def _scored(self):
        from schemas import decode

        for tp in self.tps:
            for rec in self.reader.read_range(tp, 0, None):
                yield decode(rec.value, "scored_rollout")

    def scorers(self) -> set[str]:
        """Ids of the scorers that have scored anything so far (reads the whole, small, topic)."""
        return {scored.scorer_id for scored in self._scored()}

    def stamps(self, below_epoch: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for scored in self._scored():
            if scored.rollout.epoch < below_epoch:
                out.setdefault(scored.scorer_id, []).append(float(scored.timings["created_at"]))
        return out

    def close(self) -> None:
        self.reader.close()
        self.transport.tracing.shutdown()


def table(result: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    f = result["figures"]
    rows = [["1 scorer", fmt(f["scorers1_rollouts_s"]), "1×"],
            ["2 scorers (one consumer group)", fmt(f["scorers2_rollouts_s"]), f"**{fmt(f['scale_out'])}×**"],
            ["pre-fill (this process sending)", fmt(f["prefill1_rollouts_s"]),
             f"{fmt(f['prefill_vs_one_scorer'])}× one scorer"]]
    cores = result.get("params", {}).get("cores")
    if cores:
        rows.append([f"ideal on {len(cores)} usable cores", "–", f"≤ {min(len(cores), 2)}×"])
    return ["scorers", "scored rollouts/s", "÷ 1 scorer"], rows


def headline(result: Mapping[str, Any]) -> str:
    f = result["figures"]
    return (f"2 scorers {fmt(f['scale_out'])}× one ({fmt(f['scorers1_rollouts_s'])} → "
            f"{fmt(f['scorers2_rollouts_s'])} rollouts/s; ideal ≤ 2)")
