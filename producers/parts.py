"""The producer's opt-in parts, built once at start-up from its section (and the shared ``data`` section).

Consumes: the :class:`~producers.config.ProducerConfig`, the role's transport and prompt source, its weights
follower and engine. Produces: the epoch gate (``producer.epoch_order``, :mod:`producers.epoch_gate`), the
backpressure budget and its stale feed (``producer.max_groups_per_version``, :mod:`producers.budget`,
:mod:`producers.stale_feed`), and the multi-turn settings (``producer.environment``, :class:`producers.step.Turns`),
for the loop in :mod:`producers.role`; and the start-up check that no partial group waits for a producer that
would not read it (:func:`check_partials_drained`).
Guarantees: a part that is off costs nothing (no reader, no stale feed, no environment is built); a bad
``producer.environment`` fails here, before a prompt is read.
"""

from __future__ import annotations

from producers.budget import Budget
from producers.config import ProducerConfig
from producers.engines.base import GenerationEngine
from producers.stale_feed import StaleFeed
from producers.step import Turns
from producers.weights_follower import WeightsFollower


def build_epoch_gate(transport, source, pcfg: ProducerConfig):
    """The epoch gate on the prompts topic, reading ahead with a group-less reader of its own."""
    from producers.epoch_gate import EpochGate, first_load_epoch
    from schemas import decode

    reader = transport.reader()
    topic = transport.names.prompts
    gate = EpochGate(source, lambda: reader.partitions(topic),
                     first_load_epoch(reader, lambda raw: decode(raw, "prompt")), check_every_s=pcfg.epoch_check_s)
    gate.reader = reader
    source.holds = gate.held
    return gate


def build_backpressure(transport, pcfg: ProducerConfig, follower: WeightsFollower | None,
                       engine: GenerationEngine) -> tuple[Budget, StaleFeed | None]:
    """The budget (off without ``max_groups_per_version`` or without weights to wait for) and its stale feed."""
    budget = Budget(pcfg.max_groups_per_version if follower is not None else None, pcfg.versions_ahead,
                    engine.version, pcfg.backpressure_timeout_s)
    return budget, StaleFeed(transport) if budget.share is not None else None


def build_turns(pcfg: ProducerConfig, data) -> Turns | None:
    """Multi-turn settings from ``producer.environment`` and the ``data`` section's chat template (None:
    single-turn rollouts)."""
    if pcfg.environment is None:
        return None
    from producers.environment import load_environment
    from stream_rl.prompts.templates import template_override

    mode = data.chat_template
    environments = load_environment(pcfg.environment, pcfg.env_timeout_s, pcfg.env_refills, pcfg.env_isolation)
    return Turns(environments, pcfg.max_turns, chat_template=template_override(mode),
                 chat_template_kwargs=dict(data.chat_template_kwargs), use_chat=mode != "none")


def check_partials_drained(transport, pcfg: ProducerConfig) -> None:
    """With ``producer.partial_max_lag`` unset, refuse to start (naming it) while the run's partials topic holds
    partial groups the producers' group has not resumed (it was set before): their prompts are committed, so a
    producer that does not read them would lose those groups."""
    if pcfg.partial_max_lag is not None:
        return
    from stream_rl.config.base import ConfigError
    from stream_rl.transport.ranges import end_offsets, group_commits

    topic = transport.names.partials
    ends = end_offsets(transport, topic)
    if not any(ends.values()):
        return
    commits = group_commits(transport, transport.names.group("producers"), topic)
    left = sum(max(0, end - commits.get(partition, 0)) for partition, end in ends.items())
    if left:
        raise ConfigError(f"producer.partial_max_lag is unset, but {topic} holds {left} partial group(s) the "
                          f"producers have not resumed (the run had it set): their prompts are committed, so they "
                          f"would be lost; set producer.partial_max_lag again until they are resumed")
