"""Consumer-group membership on the local broker: leaving a group safely, and noticing a member that never joins.

Consumes: kafka-python ``KafkaConsumer`` objects that subscribed to topics (group members).
Produces: :func:`close_consumer` (close without stalling the group) and :class:`AssignmentWatch` (raises
:class:`NoAssignment` for a member stuck without partitions).
Guarantees:
- ``close_consumer`` sends LeaveGroup only from a member that is stable in its group. tansu 0.6 mishandles a
  LeaveGroup from a member that is still joining or rebalancing: the group then stays unjoinable (measured: a new
  member got no assignment in 60 s; tests/test_group_membership.py). Without it the broker expires the member
  after ``session_timeout_ms`` (measured: the next member was assigned in ~11 s), as after a kill -9. A stable
  member still leaves at once, so a clean stop rebalances the rest of the group without waiting.
- ``AssignmentWatch.check`` raises once a member has had no partition for ``timeout_s`` while its group is not
  stable (a join that never completes); a member of a stable group with no partition (more members than
  partitions) is logged once and left to idle. Consumers that assign partitions themselves are never checked.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class NoAssignment(RuntimeError):
    """A group member got no partition within the bound while its group never settled."""


def _coordinator(consumer):
    coordinator = getattr(consumer, "_coordinator", None)
    subscription = getattr(consumer, "_subscription", None)
    if coordinator is None or subscription is None or not subscription.partitions_auto_assigned():
        return None
    return coordinator


def close_consumer(consumer) -> None:
    """Close ``consumer``, leaving its group only if it is a stable member (module docstring)."""
    coordinator = _coordinator(consumer)
    if coordinator is not None and (not coordinator.stable() or coordinator.need_rejoin()):
        coordinator.reset_generation()  # forget the member id: nothing to leave with
    consumer.close(autocommit=False)


class AssignmentWatch:
    """Measures how long a group member has gone without partitions (see the module docstring)."""

    def __init__(self, timeout_s: float | None, clock=time.monotonic):
        self.timeout_s, self._clock = timeout_s, clock
        self._since: float | None = None
        self._idle_logged = False

    def check(self, consumer) -> None:
        coordinator = _coordinator(consumer)
        if self.timeout_s is None or coordinator is None or consumer.assignment():
            self._since, self._idle_logged = None, False
            return
        now = self._clock()
        if self._since is None:
            self._since = now
        if coordinator.stable() and not coordinator.need_rejoin():
            if not self._idle_logged:
                log.warning("group %s is stable and gave this member no partition (more members than "
                            "partitions?): idling", coordinator.group_id)
                self._idle_logged = True
            self._since = now
            return
        if now - self._since > self.timeout_s:
            topics = ", ".join(sorted(consumer.subscription() or ()))
            raise NoAssignment(f"no partition of {topics} assigned in group {coordinator.group_id} within "
                               f"{self.timeout_s:.0f}s (kafka.assignment_timeout_s): the group never settled; "
                               f"check `stream-rl status` and the broker, then restart this role")
