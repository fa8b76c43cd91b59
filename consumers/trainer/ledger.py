"""The trainer's dedup ledger: which (prompt, epoch) groups are trained, compacted so it stays small.

Consumes: trained groups (``prompt_id``, ``epoch``) from the batcher, and a checkpoint's ledger JSON (this format,
or the earlier one that listed every trained rollout id).
Produces: exact membership answers (:meth:`Ledger.trained`) and the JSON a checkpoint stores (:meth:`to_json`).
Guarantees:
- Exact: compaction never forgets a group and never invents one. Rollout ids are deterministic,
  ``{prompt_id}:{epoch}:{sample}`` (``schemas.ids``), and groups are trained whole, so a rollout is a duplicate
  exactly when its (prompt, epoch) is in the ledger.
- Compact: per prompt, a *floor* F (every epoch below F is trained) plus the trained epochs at or above F that
  arrived ahead of an older one. ``prompts load`` numbers epochs 0, 1, 2, ... and epochs are trained roughly in
  order, so a prompt costs one entry however many epochs the run trains; the size is the number of distinct
  prompts plus the epochs trained out of order, independent of the run's length::

      trained (p7, 0), (p7, 2)      ->  p7: floor 1, ahead {2}
      trained (p7, 1)               ->  p7: floor 3, ahead {}

Why not drop ids below the checkpointed safe offsets instead: a duplicate is not a re-read of an old offset, it is
a new record at a new offset (a producer that died before committing its prompt regenerates the same ids, hours
later if it stayed down), so a ledger keyed on offsets would train it twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def split_rollout_id(rollout_id: str) -> tuple[str, int]:
    """(prompt_id, epoch) of a deterministic rollout id ``{prompt_id}:{epoch}:{sample}``."""
    prompt_id, epoch, _sample = rollout_id.rsplit(":", 2)
    return prompt_id, int(epoch)


class Ledger:
    """Trained (prompt, epoch) groups, per prompt as a floor plus the epochs trained ahead of it."""

    def __init__(self) -> None:
        self._floor: dict[str, int] = {}
        self._ahead: dict[str, set[int]] = {}

    def trained(self, prompt_id: str, epoch: int) -> bool:
        return epoch < self._floor.get(prompt_id, 0) or epoch in self._ahead.get(prompt_id, ())

    def add(self, prompt_id: str, epoch: int) -> None:
        """Record (prompt_id, epoch) as trained, then raise the prompt's floor over every epoch now contiguous."""
        if self.trained(prompt_id, epoch):
            return
        floor = self._floor.get(prompt_id, 0)
        ahead = self._ahead.setdefault(prompt_id, set())
        ahead.add(epoch)
        while floor in ahead:
            ahead.discard(floor)
            floor += 1
        self._floor[prompt_id] = floor
        if not ahead:
            del self._ahead[prompt_id]

    def prompts(self) -> int:
        """Distinct prompts with at least one trained epoch."""
        return len(self._floor)

    def top_epoch(self) -> int:
        """The highest epoch trained for any prompt (-1 when nothing is trained)."""
        floors = (f - 1 for f in self._floor.values())
        return max([*floors, *(max(a) for a in self._ahead.values() if a)], default=-1)

    def entries(self) -> int:
        """Stored numbers: one floor per prompt plus every epoch held ahead of a floor (the ledger's size)."""
        return len(self._floor) + sum(len(v) for v in self._ahead.values())

    def groups(self) -> set[tuple[str, int]]:
        """Every trained (prompt_id, epoch), expanded (for tests and tools; the ledger itself stays compact)."""
        out = {(p, e) for p, floor in self._floor.items() for e in range(floor)}
        return out | {(p, e) for p, ahead in self._ahead.items() for e in ahead}

    def to_json(self) -> dict[str, list]:
        """``{prompt_id: [floor, [epochs ahead, sorted]]}``, sorted by prompt id."""
        return {p: [self._floor[p], sorted(self._ahead.get(p, ()))] for p in sorted(self._floor)}

    @classmethod
    def from_json(cls, groups: Mapping[str, Any] | None = None, rollout_ids: Iterable[str] = ()) -> Ledger:
        """A ledger from :meth:`to_json`'s form, and/or from the earlier checkpoint form (every trained rollout
        id), which is compacted on the way in."""
        ledger = cls()
        for prompt_id, (floor, ahead) in (groups or {}).items():
            ledger._floor[str(prompt_id)] = int(floor)
            for epoch in ahead:
                ledger.add(str(prompt_id), int(epoch))
        for rollout_id in rollout_ids:
            ledger.add(*split_rollout_id(rollout_id))
        return ledger
