"""``stream-rl rescore``: score a run's logged rollouts again, with another reward, into a new scored topic.

Consumes: the source run's ``{prefix}.{from_run}.rollouts`` from a start offset per partition (default: the
earliest) up to the high-water marks seen when the job starts (or ``--until-offset``), in a consumer group of its
own (default ``{target scored topic}.rescore``).
Produces: ``ScoredRollout`` records on the target scored topic, keyed by ``group_id``: the new run's
``{prefix}.{to_run}.scored`` (``--to-run``; every topic of the new run is created, so its trainer can start on
it) or an explicit topic (``--to-topic T``, created with ``topics.partitions['scored']``). Dead letters (with
reason and source offset) go to the target's DLQ (``{prefix}.{to_run}.dlq``, or ``T.dlq``), and a dead-lettered
rollout's group gets a ``MemberRejected`` on the target scored topic, exactly as the scorer does.

One iteration is the scorer's (:mod:`consumers.scorer.scorer`, same pure step, same sends)::

    poll(<= batch_size, inside [start, end)) ─> score_and_send ─> sink.flush() (broker acked) ─> commit

Guarantees:
- The source run is never written to or committed in: the target may not be any topic of the source run (nor
  its DLQ), the group may not be a role group of the source or target run, and the source is read by assignment
  (:mod:`stream_rl.transport.ranges`), so the source run's groups see nothing.
- Every rollout in the range is read once and yields one scored rollout or one dead letter; the job stops at
  the ends it measured at start, so it terminates on a topic that is still being written.
- A target scored topic that already holds records, or a group that already committed offsets on the source, is
  refused unless ``append``: then each partition continues from ``max(start, the group's commit)``, which makes a
  killed rescore resumable (commits follow the broker's acknowledgement of everything before them). At least
  once: a batch sent but not committed before a kill is scored again on resume; the trainer drops duplicates by
  ``rollout_id``.
- Every refusal is a :class:`RescoreError` whose message names the option at fault; nothing is written before
  the checks pass.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from consumers.scorer.config import ScorerConfig
from stream_rl.rewards.contract import RewardFnError
from consumers.scorer.scorer import ScorerStats, score_and_send, send_notices
from consumers.scorer.scoring import Scoring, load_scoring
from schemas import TOPIC_PATTERN
from stream_rl.config.shared import SharedConfig
from stream_rl.rewards.routing import resolve_fn
from stream_rl.transport.client import Transport
from stream_rl.transport.ranges import BoundedSource, end_offsets, group_commits, topic_exists
from stream_rl.transport.topics import CONSUMER_GROUPS, LOGICAL_TOPICS, TopicNames, ensure_topics

log = logging.getLogger(__name__)


class RescoreError(ValueError):
    """A rescore that must not run as asked; the message names the option at fault."""


@dataclass(frozen=True)
class Offsets:
    """Offsets per partition from the command line: ``by_partition``, else ``default`` (None: the natural bound,
    the earliest offset for a start, the high-water mark at start for an end)."""

    default: int | None = None
    by_partition: dict[int, int] = field(default_factory=dict)

    def at(self, partition: int) -> int | None:
        return self.by_partition.get(partition, self.default)

    def __str__(self) -> str:
        parts = [] if self.default is None else [str(self.default)]
        return ",".join(parts + [f"{p}:{o}" for p, o in sorted(self.by_partition.items())]) or "-"


def parse_offsets(text: str, option: str, word: str) -> Offsets:
    """``word`` (``earliest``/``end``) -> the bound; ``N`` -> every partition; ``P:N,P:N`` -> those partitions
    (a bare ``N`` among them sets the others). Raises RescoreError naming ``option``."""
    if text.strip() in ("", word):
        return Offsets()
    default, by_partition = None, {}
    try:
        for item in (part.strip() for part in text.split(",")):
            partition, _, offset = item.rpartition(":")
            value = int(offset)
            if value < 0 or (partition and int(partition) < 0):
                raise ValueError("negative")
            if partition:
                by_partition[int(partition)] = value
            else:
                default = value
    except ValueError:
        raise RescoreError(f"{option} {text!r}: expected {word}, an offset N (every partition) or PARTITION:N "
                           f"pairs separated by commas, all >= 0") from None
    return Offsets(default, by_partition)


def partition_ranges(ends: dict[int, int], start: Offsets, until: Offsets,
                     committed: dict[int, int]) -> dict[int, tuple[int, int]]:
    """``{partition: (first offset, end offset)}``: from ``max(start, committed)`` to ``min(until, end)``."""
    for option, offsets in (("--from-offset", start), ("--until-offset", until)):
        unknown = sorted(set(offsets.by_partition) - set(ends))
        if unknown:
            raise RescoreError(f"{option}: partition {unknown[0]} does not exist (the source topic has "
                               f"{len(ends)} partitions, 0..{len(ends) - 1})")
    out = {}
    for partition, mark in sorted(ends.items()):
        stop = min(mark, until.at(partition) if until.at(partition) is not None else mark)
        first = max(start.at(partition) or 0, committed.get(partition, 0))
        out[partition] = (min(first, stop), stop)
    return out


@dataclass(frozen=True)
class RescorePlan:
    """What a rescore reads, writes and commits, resolved from the options (printed by ``--dry-run``)."""

    source_run: str
    source_topic: str
    target_run: str | None
    scored_topic: str
    dlq_topic: str
    group: str
    scorer: ScorerConfig
    start: Offsets
    until: Offsets
    append: bool

    def describe(self) -> dict[str, Any]:
        return {"source_run": self.source_run, "source_topic": self.source_topic, "target_run": self.target_run,
                "scored_topic": self.scored_topic, "dlq_topic": self.dlq_topic, "group": self.group,
                "reward_fn": self.scorer.reward_fn, "reward_fn_weight": self.scorer.reward_fn_weight,
                "reward_model_dir": _str(self.scorer.reward_model_dir),
                "reward_model_weight": self.scorer.reward_model_weight,
                "reference_model_dir": _str(self.scorer.reference_model_dir),
                "from_offset": str(self.start) if self.start != Offsets() else "earliest",
                "until_offset": str(self.until) if self.until != Offsets() else "end (high-water marks at start)",
                "append": self.append}


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def reward_reference(value: str) -> str | None:
    """``--reward``: ``none`` -> no rule-based reward; a built-in short name (``exact_match``, ``gsm8k``,
    ``code_tests``: :mod:`stream_rl.rewards.names`) or ``module:function`` as is. The function is imported here,
    so a bad one fails before anything runs."""
    if value.strip().lower() in ("none", "null"):
        return None
    try:
        resolve_fn(value)
    except RewardFnError as exc:
        raise RescoreError(f"--reward: {exc}") from None
    return value


def rescore_scorer(base: ScorerConfig, reward: str | None, reward_model: Path | None) -> ScorerConfig:
    """The run's scorer settings with the new reward function and/or reward model (``none`` removes one)."""
    values = base.model_dump()
    if reward is not None:
        values["reward_fn"] = reward_reference(reward)
    if reward_model is not None:
        values["reward_model_dir"] = None if str(reward_model).lower() in ("none", "null") else reward_model
    values["scorer_id"] = None  # the transport's rescore-<random>: rescored records say who scored them
    if values["reward_fn"] is None and values["reward_model_dir"] is None:
        raise RescoreError("--reward none leaves no reward source: also give --reward-model DIR")
    try:
        return ScorerConfig(**values)
    except ValidationError as exc:
        raise RescoreError(f"--reward/--reward-model: {exc.errors()[0]['msg']}") from None


def plan_rescore(cfg: SharedConfig, scfg: ScorerConfig, *, from_run: str | None = None,
                 to_run: str | None = None, to_topic: str | None = None, group: str | None = None,
                 reward: str | None = None,
                 reward_model: Path | None = None, from_offset: str = "earliest", until_offset: str = "end",
                 append: bool = False) -> RescorePlan:
    """Resolve and check the options without contacting the broker (``scfg``: the run's scorer section, the
    base of the rescore's); raises RescoreError naming the option."""
    source = TopicNames(cfg.topics.prefix, from_run or cfg.topics.run)
    scored, dlq = _target_topics(source, to_run, to_topic)
    group = group or f"{scored}.rescore"
    runs = [source.run] + ([to_run] if to_run else [])
    role_groups = {TopicNames(source.prefix, run).group(name): run for run in runs for name in CONSUMER_GROUPS}
    if group in role_groups:
        raise RescoreError(f"--group {group} is a consumer group of run {role_groups[group]}: the rescore commits "
                           f"in a group of its own (leave --group out for {scored}.rescore)")
    if not TOPIC_PATTERN.match(group):
        raise RescoreError(f"--group {group!r}: use letters, digits, '.', '_' and '-' only")
    return RescorePlan(source_run=source.run, source_topic=source.rollouts, target_run=to_run, scored_topic=scored,
                       dlq_topic=dlq, group=group, scorer=rescore_scorer(scfg, reward, reward_model),
                       start=parse_offsets(from_offset, "--from-offset", "earliest"),
                       until=parse_offsets(until_offset, "--until-offset", "end"), append=append)


def _target_topics(source: TopicNames, to_run: str | None, to_topic: str | None) -> tuple[str, str]:
    """(scored topic, DLQ topic) of the target; refuses any topic of the source run."""
    if (to_run is None) == (to_topic is None):
        raise RescoreError("give exactly one of --to-run NEW_RUN (the new run's scored topic) and --to-topic TOPIC")
    option, value = ("--to-run", to_run) if to_run is not None else ("--to-topic", to_topic)
    if not TOPIC_PATTERN.match(value):
        raise RescoreError(f"{option} {value!r}: use letters, digits, '.', '_' and '-' only")
    if to_run == source.run:
        raise RescoreError(f"--to-run {to_run} is the source run: rescored rollouts go to a new run, never into "
                           f"the source run's {source.scored} (choose another name)")
    if to_run is not None:
        target = TopicNames(source.prefix, to_run)
        return target.scored, target.dlq
    for topic in (to_topic, f"{to_topic}.dlq"):
        logical = source.logical(topic)
        if logical is not None and (logical in LOGICAL_TOPICS or logical.startswith("weights.")):
            raise RescoreError(f"--to-topic {to_topic}: {topic} is a topic of the source run {source.run}, which "
                               f"a rescore never writes to (choose a topic outside it, or --to-run NEW_RUN)")
    return to_topic, f"{to_topic}.dlq"


@dataclass
class RescoreStats:
    """What one rescore did (its one-line summary)."""

    read: int = 0
    scored: int = 0
    dead_lettered: int = 0
    batches: int = 0
    complete: bool = False
    """Every partition reached its end (False when stopped early: run again with ``append`` to continue)."""
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)


def target_config(cfg: SharedConfig, plan: RescorePlan) -> SharedConfig:
    """``cfg`` for the rescore's own clients: the target run's topic names (``--to-run``) and a run directory of
    its own next to the source's (spans, if exported, never land in the source run's directory)."""
    out = cfg.model_copy(deep=True)
    if plan.target_run is not None:
        out.topics.run = plan.target_run
    out.run_dir = Path(cfg.run_dir).parent / (plan.target_run or plan.scored_topic)
    return out


def check_and_measure(transport: Transport, plan: RescorePlan) -> dict[int, tuple[int, int]]:
    """Refuse a missing source or a used target (module docstring); return the ranges to read."""
    option, value = ("--to-run", plan.target_run) if plan.target_run else ("--to-topic", plan.scored_topic)
    if not topic_exists(transport, plan.source_topic):
        raise RescoreError(f"--from-run {plan.source_run}: topic {plan.source_topic} does not exist on "
                           f"{transport.bootstrap} (`stream-rl topics list --all` lists the topics)")
    if topic_exists(transport, plan.scored_topic) and not plan.append:
        held = sum(end_offsets(transport, plan.scored_topic).values())
        if held:
            raise RescoreError(f"{option} {value}: {plan.scored_topic} already holds {held} records: pass --append "
                               f"to add to it (continuing group {plan.group}), or choose a new {option}")
    committed = group_commits(transport, plan.group, plan.source_topic)
    if committed and not plan.append:
        raise RescoreError(f"--group {plan.group} already committed offsets on {plan.source_topic} (an earlier "
                           f"rescore): pass --append to continue it, or choose another --group")
    return partition_ranges(end_offsets(transport, plan.source_topic), plan.start, plan.until,
                            committed if plan.append else {})


def create_target(transport: Transport, plan: RescorePlan) -> None:
    """Every topic of the new run (``--to-run``), else the scored topic and its DLQ (idempotent)."""
    with transport.admin() as admin:
        if plan.target_run is not None:
            ensure_topics(admin, transport.cfg.topics)
        else:
            parts = transport.cfg.topics.partitions
            ensure_topics(admin, transport.cfg.topics, logical=(),
                          extra={plan.scored_topic: parts.get("scored", 1), plan.dlq_topic: parts.get("dlq", 1)})


def run_rescore(cfg: SharedConfig, plan: RescorePlan, stop_event: threading.Event | None = None, *,
                scoring: Scoring | None = None) -> RescoreStats:
    """Check, create the target, then score every rollout of the planned ranges (module docstring)."""
    transport = Transport(target_config(cfg, plan), "rescore")
    try:
        stats = RescoreStats(ranges=check_and_measure(transport, plan))
        if scoring is None:
            scoring = load_scoring(plan.scorer, transport.instance_id)
        create_target(transport, plan)
        _score_ranges(transport, plan, scoring, stats, stop_event)
    finally:
        transport.tracing.shutdown()
    return stats


def _score_ranges(transport: Transport, plan: RescorePlan, scoring: Scoring, stats: RescoreStats,
                  stop_event: threading.Event | None) -> None:
    sink = transport.sink()
    bounded = BoundedSource.open(transport, plan.source_topic, stats.ranges, plan.group, "rollout", sink,
                                 plan.dlq_topic, keep_rejections=True)  # their groups: a MemberRejected on the target
    counts = ScorerStats()
    log.info("rescore %s -> %s in group %s, ranges %s", plan.source_topic, plan.scored_topic, plan.group,
             stats.ranges)
    try:
        while not bounded.done and not (stop_event is not None and stop_event.is_set()):
            before = bounded.positions()
            records = bounded.poll(plan.scorer.poll_timeout_s, plan.scorer.batch_size)
            send_notices(bounded.source, sink, plan.scored_topic, transport.instance_id)
            if records:
                score_and_send(records, bounded.source, sink, plan.scored_topic, scoring, counts,
                               transport.instance_id)
                stats.batches += 1
            if bounded.positions() != before or sink.pending:
                sink.flush()  # scored rollouts and dead letters acknowledged before their offsets are committed
                bounded.commit()
        stats.complete = bounded.done
    finally:
        bounded.close()
        sink.close()
    stats.read, stats.scored, stats.dead_lettered = bounded.read, counts.scored, bounded.source.dead_lettered


def summary(plan: RescorePlan, stats: RescoreStats) -> str:
    """The one line a rescore ends with."""
    state = "rescored" if stats.complete else "stopped early (run again with --append to continue):"
    return (f"{state} {plan.source_topic} -> {plan.scored_topic}: read {stats.read}, scored {stats.scored}, "
            f"dead-lettered {stats.dead_lettered} ({plan.dlq_topic}); group {plan.group}")
