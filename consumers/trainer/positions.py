"""Where the trainer reads: every scored partition assigned explicitly and positioned from the trainer's own state.

Consumes: the trainer's :class:`~stream_rl.transport.edge.Source` (group id kept for commits), the scored topic,
a group-less reader for high-water marks, the checkpoint's offsets (``{(topic, partition): offset}``) and ``trainer.accept_offset_loss``.
Produces: the source assigned to every partition of the topic and positioned there; the start offset of every
partition (what a checkpoint records for a partition on which nothing was read yet).
Guarantees:
- No group membership: ``assign``, never ``subscribe``. The trainer never waits for a group join and no rebalance
  ever moves a partition, so a group left unjoinable (tansu 0.6 keeps naming a member that stopped during its
  first join as the leader) cannot stall it. The group id is kept only for commits (generation -1, accepted by
  Apache Kafka for a group with no active member and by tansu 0.6 even with such a stuck member), so that
  ``stream-rl status`` can read the trainer's lag; a commit the broker refuses is logged, never fatal.
- Every partition is positioned explicitly, never by a committed offset or ``auto_offset_reset``: at its
  checkpoint offset, or at the broker's first offset (its low watermark, ListOffsets(earliest)) when the
  checkpoint has none (no checkpoint, or nothing was read there yet).
- A checkpoint offset outside the broker's range ``[low, high]`` of its partition (``high``: the high-water mark
  from a fetch response, since ListOffsets(latest) is wrong on tansu 0.6) means records are gone: the topic was
  re-created or truncated (offset > high) or retention deleted unread records (offset < low). The trainer stops
  with :class:`OffsetLossError` naming the partition, the offset and the range, unless ``accept_offset_loss``:
  then the same facts are logged as a warning and the partition is read from ``low``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

Key = tuple[str, int]


class OffsetLossError(RuntimeError):
    """A checkpointed offset does not exist on the broker: reading on would skip (or re-read) data silently."""


def scored_partitions(source, topic: str, timeout_s: float = 10.0) -> list[Key]:
    """Every partition of ``topic``; a missing topic is an error naming it and the command that creates it."""
    try:
        return source.partitions(topic, timeout_s)
    except KeyError:
        raise RuntimeError(f"the scored topic {topic} does not exist on the broker: create the run's topics with "
                           f"`stream-rl topics create`") from None


def check_offset(key: Key, offset: int, low: int, high: int, accept_loss: bool) -> int:
    """Where partition ``key`` continues given its checkpoint ``offset`` and the broker's range ``[low, high]``
    (pure; see the module docstring)."""
    if low <= offset <= high:
        return offset
    what = ("beyond the end: the topic was re-created or truncated" if offset > high else
            "before the start: records were deleted (retention) before the trainer read them")
    facts = (f"checkpoint offset {offset} of {key[0]}[{key[1]}] is outside the broker's range [{low}, {high}) "
             f"({what})")
    if not accept_loss:
        raise OffsetLossError(f"{facts}; set trainer.accept_offset_loss=true to continue from offset {low}")
    log.warning("%s; trainer.accept_offset_loss is set: continuing from offset %d", facts, low)
    return low


def assign_and_position(source, reader, topic: str, checkpoint: Mapping[Key, int],
                        accept_loss: bool) -> dict[Key, int]:
    """Assign ``source`` every partition of ``topic`` and seek each to where reading continues; returns the
    start offset of every partition. ``reader`` (a group-less :class:`~stream_rl.transport.reader.Reader`) measures
    the high-water marks."""
    keys = scored_partitions(source, topic)
    lows = source.beginning_offsets(keys)
    stored = {key: checkpoint[key] for key in keys if key in checkpoint}
    present = set(keys)
    for key, offset in sorted(checkpoint.items()):  # a partition that is gone: its range is empty
        if key[0] == topic and key not in present:
            check_offset(key, offset, 0, 0, accept_loss)
    highs = reader.highwaters(list(stored)) if stored else {}
    start: dict[Key, int] = {}
    for key in keys:
        low = lows[key]
        start[key] = check_offset(key, stored[key], low, int(highs[key]), accept_loss) if key in stored else low
    source.assign(start)
    log.info("reading %s from %s", topic, ", ".join(f"[{p}]@{o}" for (_, p), o in sorted(start.items())))
    return start


def assigned_source(transport, group: str, kind: str | tuple[str, ...], sink, **edge):
    """The transport's :class:`~stream_rl.transport.edge.Source` on the scored topic, without its subscription
    (the caller assigns the partitions: :func:`assign_and_position`); ``group`` is used for commits only;
    ``edge``: the source's options (``keep_rejections``, ``pause_when``, see ``Transport.source``)."""
    source = transport.source([transport.names.scored], group, kind, sink, **edge)
    source.unsubscribe()  # before any poll: no join was started, so nothing is sent to the group
    return source
