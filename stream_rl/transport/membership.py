"""Consumer-group membership on the local broker: leaving a group safely, and noticing a member that never joins.

Consumes: kafka-python ``KafkaConsumer`` objects that subscribed to topics (group members).
Produces: :func:`close_consumer` (close without breaking the group) and :class:`AssignmentWatch` (raises
:class:`NoAssignment` for a member stuck without partitions).
Guarantees:
- ``close_consumer`` sends no LeaveGroup unless asked to (``kafka.leave_group_on_close``), and then only from a
  member that is stable in its group. tansu 0.6 mishandles a LeaveGroup sent while its group is rebalancing,
  whoever sends it: the group then hands no partition to anyone for minutes. The client cannot see the broker's
  side: two stable members closed one after the other broke the group in 1 of 3 tries (the second leave lands
  in the rebalance the first one started), and two stable members closed while a third was joining broke it in
  3 of 3 (tests/integration/test_group_membership.py). Without a LeaveGroup the broker expires the member after
  ``session_timeout_ms``, as after a kill -9 (measured: the next member was assigned in ~11 s). On Apache Kafka,
  which handles a leave in any state, ``kafka.leave_group_on_close=true`` hands a stopped member's partitions
  to the rest of its group at once.
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


def close_consumer(consumer, leave: bool = False) -> None:
    """Close ``consumer``; leave its group only if ``leave`` and it is a stable member (module docstring)."""
    coordinator = _coordinator(consumer)
    if coordinator is not None and (not leave or not coordinator.stable() or coordinator.need_rejoin()):
        coordinator.reset_generation()  # forget the member id: nothing to leave with; the broker expires it
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
