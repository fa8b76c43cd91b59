"""The producer's view of the trainer's drops: group ids from the run's stale topic, for the backpressure budget.

Consumes: the run's stale topic (``StaleRollout`` records, one per dropped rollout, key ``group_id``), read
group-less by assignment, from the high-water marks taken from fetch responses when the feed starts (the broker's
ListOffsets(latest) cannot be trusted): only drops after the producer started matter to its budget.
Produces: the group ids of the stale records that arrived since the last ``poll``.
Guarantees:
- Never blocks longer than the ``timeout_s`` given; never commits (no consumer group).
- Invalid records are skipped with a warning and counted (``invalid``): this reader does not own the topic.
- A stale topic missing at start-up is an error naming it and the command that creates it.
"""

from __future__ import annotations

import logging

from schemas import SchemaError, decode

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0


class StaleFeed:
    """Group ids of the trainer's stale records since the feed started."""

    def __init__(self, transport):
        self.topic = transport.names.stale
        self.invalid = 0
        self._reader = transport.reader()
        try:
            parts = self._reader.partitions(self.topic, timeout_s=START_TIMEOUT_S)
        except KeyError:
            self._reader.close()
            raise RuntimeError(f"stale topic {self.topic} does not exist (the producer's backpressure reads it); "
                               f"create the run's topics with `stream-rl topics create`") from None
        self._reader.follow(self._reader.highwaters(parts, timeout_s=START_TIMEOUT_S))

    def poll(self, timeout_s: float = 0.0) -> list[str]:
        """Group ids of the stale records that arrived since the last call (in partition order)."""
        out: list[str] = []
        for rec in self._reader.poll(timeout_s):
            try:
                out.append(decode(rec.value, "stale_rollout").group_id)
            except SchemaError as exc:
                self.invalid += 1
                log.warning("skipping invalid record %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, exc)
        return out

    def close(self) -> None:
        self._reader.close()
