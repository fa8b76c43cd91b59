"""Policy versions on the trained line of weights, across resumes that republished a checkpoint under a new number.

Consumes: the jumps a resumed trainer made (``TrainState.lineage``): ``(base, republished)`` pairs, meaning version
``republished`` carries the weights of version ``base`` (the checkpoint), and versions ``base+1 .. republished-1``
were published by a trainer that crashed after that checkpoint: a dead branch whose weights no longer exist.
Produces: the number of optimizer steps between the weights of a behaviour version and the trainer's current
weights (:meth:`Lineage.lag`), which is what the staleness bound means.
Guarantees (pure): with no jumps, ``lag(b, v) = v - b``. A resume alone never makes data stale: a rollout generated
at the checkpoint's version or before keeps the lag it had from the checkpoint, and one generated on the dead branch
is as far from the current weights as the path through the branch point (its own steps past ``base`` plus the
steps trained since the resume)::

    versions:  24   25 ──26──27──28        (26-28: published after checkpoint 25, then the trainer crashed)
                     └──────────────29──30  (29 = 25's weights republished; 30 = one step later)
    lag(24, 30) = 2    lag(27, 30) = 2 + 1 = 3    lag(29, 30) = 1    (without the lineage: 6, 3, 1)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Lineage:
    """The resume jumps of one run, oldest first (see the module docstring)."""

    jumps: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, pairs: Iterable[Sequence[int]]) -> Lineage:
        jumps = tuple(sorted((int(b), int(r)) for b, r in pairs))
        for base, republished in jumps:
            if not 0 <= base < republished:
                raise ValueError(f"lineage jump ({base}, {republished}): the republished version must be newer")
        return cls(jumps)

    def place(self, version: int) -> tuple[int, int]:
        """(position on the trained line, steps past it on a dead branch) of ``version``'s weights."""
        shift = 0
        for base, republished in self.jumps:
            if version >= republished:
                shift += republished - base
                continue
            if version > base:
                return base - shift, version - base
            break
        return version - shift, 0

    def lag(self, behaviour: int, current: int) -> int:
        """Optimizer steps from the weights of version ``behaviour`` to those of ``current``; negative when
        ``behaviour`` is newer than ``current`` (weights the trainer has never had)."""
        if behaviour > current:
            return current - behaviour
        (b_pos, b_branch), (c_pos, c_branch) = self.place(behaviour), self.place(current)
        return (c_pos - b_pos) + b_branch + c_branch
