"""A prompt file against the reward that will score it, judged before anything is published.

Consumes: the valid rows of a file (:class:`~stream_rl.prompts.schema.PromptRow`), its layout and columns, and a
:class:`RewardPlan`: the scorer's single ``reward_fn`` or its routes (``scorer.rewards``,
:class:`~stream_rl.rewards.routing.RewardRoutes`), as the command resolved them.
Produces: :class:`~stream_rl.prompts.schema.Problem` entries for :func:`~stream_rl.prompts.check.check_prompt_file`:

- error, once per reward: rows without an answer that a reward needing one would score (every built-in verifier
  and simple reward, :data:`~stream_rl.rewards.names.NEED_ANSWER`, compares with the reference answer), naming the reward, how
  many rows, the answer column read (or that none was found) and the file's columns;
- error, once per metadata value: rows that no route takes and no default scores (the scorer would dead-letter
  every rollout of them);
- warning, once per metadata value: rows the default scores because their value has no route
  (:func:`~stream_rl.rewards.routing.fall_through`), with the count: a misspelt source name changes the verifier.

Guarantees: pure (no reward function is imported or called: a ``module:function`` is not known to need an answer,
so only the built-ins are held to it); problems name lines, columns and metadata values, never prompt text.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from stream_rl.prompts.schema import Problem, PromptRow
from stream_rl.rewards.routing import RewardRoutes, UnroutedError, fall_through, route
from stream_rl.rewards.names import NEED_ANSWER


@dataclass(frozen=True)
class RewardPlan:
    """What scores the prompts: ``routes`` (``scorer.rewards``) when set, else ``reward_fn`` for every row."""

    reward_fn: str | None = None
    routes: RewardRoutes | None = None

    def functions(self, row: PromptRow) -> tuple[str, ...]:
        """The functions that score ``row``; UnroutedError when no route takes it and there is no default."""
        if self.routes is not None:
            return tuple(term.fn for term in route(self.routes, row.metadata))
        return (self.reward_fn,) if self.reward_fn else ()

    def where(self, fn: str) -> str:
        return "scorer.rewards" if self.routes is not None else f"scorer.reward_fn = {fn!r}"


def needs_answer(fn: str) -> bool:
    """Whether reward ``fn`` compares with the reference answer: every built-in verifier and simple reward does
    (:data:`stream_rl.rewards.names.NEED_ANSWER`)."""
    return fn in NEED_ANSWER


def reward_problems(rows: Sequence[PromptRow], plan: RewardPlan | None, answer_key: str | None,
                    columns: Collection[str], unit: str) -> list[Problem]:
    """Every problem of the module docstring, errors first then warnings, each at its first row."""
    if plan is None:
        return []
    unanswered: dict[str, list[int]] = {}  # fn -> lines without an answer it needs
    unrouted: dict[str, list[int]] = {}  # reason -> lines
    fell: dict[str, list[int]] = {}  # fall-through line -> lines
    for row in rows:
        try:
            fns = plan.functions(row)
        except UnroutedError as exc:
            unrouted.setdefault(str(exc), []).append(row.line)
            continue
        if plan.routes is not None:
            line = fall_through(plan.routes, row.metadata)
            if line is not None:
                fell.setdefault(line, []).append(row.line)
        if row.answer is None:
            for fn in filter(needs_answer, fns):
                unanswered.setdefault(fn, []).append(row.line)
    shown = ", ".join(sorted(columns)) or "none"
    read = f"the answer is read from {answer_key!r}" if answer_key else "no answer column was found"
    problems = [Problem(lines[0], answer_key or "answer", f"{_count(lines, unit)} no answer, and reward {fn!r} "
                        f"({plan.where(fn)}) needs one: {read} (columns: {shown}); map it with --answer-key / "
                        f"data.answer_key") for fn, lines in unanswered.items()]
    problems += [Problem(lines[0], plan.routes.by, f"{reason}: the scorer would dead-letter every rollout of "
                         f"{_count(lines, unit, verb=False)}") for reason, lines in unrouted.items()]
    problems += [Problem(lines[0], plan.routes.by, f"{line} ({_count(lines, unit, verb=False)})", "warning")
                 for line, lines in fell.items()]
    return problems


def _count(lines: list[int], unit: str, verb: bool = True) -> str:
    n = len(lines)
    return f"{n} {unit}{'s' * (n != 1)}" + ((" have" if n != 1 else " has") if verb else "")
