"""Filters, deduplication and statistics over the valid rows of a prompt file.

Consumes: :class:`~stream_rl.prompts.schema.PromptRow` lists in file order and :class:`CheckOptions`.
Produces: the rows to publish, one :class:`Dropped` entry per removed row (its reason and, for a duplicate, the
line of the kept row it repeats), and :class:`Stats`.

Guarantees:
- Pure and deterministic: the first occurrence in file order is kept, later ones are dropped.
- Filters run before deduplication, so a duplicate always points at a row that is published.
- Filters, in order: ``empty`` (no visible character: only whitespace, control or format characters such as
  U+200B), ``too_short`` / ``too_long`` (``len(text)`` in code points, unstripped, against ``min_chars`` /
  ``max_chars``), ``too_many_tokens`` (token count, when a counter is given, against ``max_tokens``).
- Deduplication modes: ``none``; ``exact``: same ``prompt_id`` (``duplicate_id``) or byte-identical ``text``
  (``duplicate_text``); ``normalized``: ``exact`` plus same :func:`normalize_text` (``duplicate_normalized``).
- Percentiles use the nearest-rank definition: ``p``-th = the ``ceil(p/100 * n)``-th smallest value.
"""

from __future__ import annotations

import math
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stream_rl.prompts.layouts import Mapping
from stream_rl.prompts.schema import PromptRow

DEDUP_MODES = ("exact", "normalized", "none")


@dataclass(frozen=True)
class CheckOptions:
    """How :func:`check_prompt_file` judges a file. ``count_tokens`` maps a text to its token count (None: none)."""

    dedup: str = "exact"
    min_chars: int = 1
    max_chars: int | None = None
    max_tokens: int | None = None
    count_tokens: Callable[[str], int] | None = None
    strict: bool = False  # unknown fields are errors instead of warnings
    mapping: Mapping | None = None  # explicit columns (--prompt-key ... / data.*); None: detected
    renderer: Callable[[], Any] | None = None  # builds the ChatRenderer, called only when a row has messages
    reward: Any = None  # a RewardPlan (stream_rl.prompts.reward_fit): the rows are checked against it; None: not

    def __post_init__(self) -> None:
        if self.dedup not in DEDUP_MODES:
            raise ValueError(f"dedup must be one of {', '.join(DEDUP_MODES)}, got {self.dedup!r}")
        if self.min_chars < 0:
            raise ValueError(f"min_chars must be >= 0, got {self.min_chars}")
        if self.max_chars is not None and self.max_chars < max(self.min_chars, 1):
            raise ValueError(f"max_chars must be >= max(min_chars, 1), got {self.max_chars}")
        if self.max_tokens is not None and (self.max_tokens < 1 or self.count_tokens is None):
            raise ValueError("max_tokens must be >= 1 and needs a tokenizer")


@dataclass(frozen=True)
class Dropped:
    """A valid row left out of the load: ``reason`` and, for duplicates, ``of_line`` (the kept row's line)."""

    line: int
    prompt_id: str
    reason: str
    detail: str
    of_line: int | None = None

    def to_dict(self) -> dict:
        return {"line": self.line, "prompt_id": self.prompt_id, "reason": self.reason, "detail": self.detail,
                "of_line": self.of_line}


@dataclass(frozen=True)
class Stats:
    """Counts over the file; ``chars`` / ``tokens`` summarise the kept rows (None when nothing is kept)."""

    rows: int  # records read (blank JSON lines excluded), valid or not
    valid: int  # records that passed the schema check
    kept: int  # rows left after filters and deduplication: what `prompts load` publishes per epoch
    unique_texts: int  # distinct exact texts among the valid rows
    unique_normalized: int  # distinct normalized texts among the valid rows
    dropped: dict[str, int]  # reason -> count
    chars: dict[str, float] | None
    tokens: dict[str, float] | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def normalize_text(text: str) -> str:
    """The dedup key of ``normalized`` mode: NFKC, casefold, NFKC again (Unicode's compatibility caseless form),
    then every run of whitespace collapsed to one space and the ends stripped. ``"  2+2= "``, ``"2+2="`` and
    the full-width ``"２+２="`` all give ``"2+2="``."""
    folded = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())
    return " ".join(folded.split())


def has_visible_char(text: str) -> bool:
    """True when some character is neither a separator (Z*) nor a control/format/unassigned one (C*)."""
    return any(unicodedata.category(ch)[0] not in "ZC" for ch in text)


def _filter_reason(row: PromptRow, tokens: int | None, opts: CheckOptions) -> tuple[str, str] | None:
    n = len(row.text)
    if not has_visible_char(row.text):
        return "empty", "no visible character"
    if n < opts.min_chars:
        return "too_short", f"{n} characters < min_chars {opts.min_chars}"
    if opts.max_chars is not None and n > opts.max_chars:
        return "too_long", f"{n} characters > max_chars {opts.max_chars}"
    if opts.max_tokens is not None and tokens is not None and tokens > opts.max_tokens:
        return "too_many_tokens", f"{tokens} tokens > max_tokens {opts.max_tokens}"
    return None


def apply_filters(rows: Sequence[PromptRow], opts: CheckOptions,
                  token_counts: Sequence[int] | None = None) -> tuple[list[PromptRow], list[Dropped]]:
    """Rows passing the emptiness, length and token filters, and a :class:`Dropped` for each of the others."""
    kept, dropped = [], []
    for i, row in enumerate(rows):
        reason = _filter_reason(row, None if token_counts is None else token_counts[i], opts)
        if reason is None:
            kept.append(row)
        else:
            dropped.append(Dropped(row.line, row.prompt_id, *reason))
    return kept, dropped


def deduplicate(rows: Sequence[PromptRow], mode: str) -> tuple[list[PromptRow], list[Dropped]]:
    """First occurrences kept; each later duplicate dropped naming the line of the row it repeats."""
    if mode == "none":
        return list(rows), []
    by_id: dict[str, PromptRow] = {}
    by_text: dict[str, PromptRow] = {}
    by_norm: dict[str, PromptRow] = {}
    kept, dropped = [], []
    for row in rows:
        norm = normalize_text(row.text) if mode == "normalized" else None
        if row.prompt_id in by_id:
            first = by_id[row.prompt_id]
            same = "same text" if first.text == row.text else "different text"
            dropped.append(Dropped(row.line, row.prompt_id, "duplicate_id", f"prompt_id already used ({same})",
                                   first.line))
        elif row.text in by_text:
            dropped.append(Dropped(row.line, row.prompt_id, "duplicate_text", "identical text",
                                   by_text[row.text].line))
        elif norm is not None and norm in by_norm:
            dropped.append(Dropped(row.line, row.prompt_id, "duplicate_normalized", "same normalized text",
                                   by_norm[norm].line))
        else:
            by_id[row.prompt_id] = by_text[row.text] = row
            if norm is not None:
                by_norm[norm] = row
            kept.append(row)
    return kept, dropped


def duplicate_ids(rows: Sequence[PromptRow]) -> list[tuple[PromptRow, int]]:
    """Each row whose prompt_id an earlier row already has, with that earlier row's line."""
    first: dict[str, int] = {}
    out = []
    for row in rows:
        if row.prompt_id in first:
            out.append((row, first[row.prompt_id]))
        else:
            first[row.prompt_id] = row.line
    return out


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank ``p``-th percentile (0 < p <= 100) of an ascending, non-empty sequence."""
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    """``min``, ``mean``, ``p50``, ``p95``, ``max`` of ``values`` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return {"min": ordered[0], "mean": sum(ordered) / len(ordered), "p50": percentile(ordered, 50),
            "p95": percentile(ordered, 95), "max": ordered[-1]}


def compute_stats(rows_read: int, valid: Sequence[PromptRow], kept: Sequence[PromptRow],
                  dropped: Sequence[Dropped], kept_tokens: Sequence[int] | None = None) -> Stats:
    """:class:`Stats` of a file: counts over ``valid``, length summaries over ``kept``."""
    return Stats(rows=rows_read, valid=len(valid), kept=len(kept),
                 unique_texts=len({row.text for row in valid}),
                 unique_normalized=len({normalize_text(row.text) for row in valid}),
                 dropped=dict(Counter(d.reason for d in dropped)),
                 chars=summarize([len(row.text) for row in kept]),
                 tokens=None if kept_tokens is None else summarize(kept_tokens))
