"""Checking a whole prompt file: schema, filters, deduplication and statistics, before anything is published.

Consumes: a prompt file (:mod:`stream_rl.prompts.sources`) and :class:`~stream_rl.prompts.clean.CheckOptions`.
Produces: a :class:`PromptReport`: the rows to publish, every problem (errors and warnings, by line), every
dropped row with its reason, and :class:`~stream_rl.prompts.clean.Stats`; :func:`read_prompt_file` for callers
that only want the rows or an exception.

Guarantees:
- The whole file is read and judged before the report exists, so a caller can refuse to publish anything when
  :attr:`PromptReport.valid` is false.
- The layout (plain, verl, TRL or mapped columns; :mod:`stream_rl.prompts.layouts`) is detected once per file
  from its columns; a mapped column that is not there is a :class:`PromptFileError` naming it and the file.
- Conversational rows are rendered (:mod:`stream_rl.prompts.render`) before filters and dedup, so lengths,
  token counts, ``--max-tokens`` and duplicates are judged on the rendered prompt the policy will read.
- Errors (the file is invalid): an undecodable line, a schema violation, a text the tokenizer rejects, messages
  that cannot be rendered (no template, ``none``, a template that raises: each on its line), with
  ``dedup="none"`` a ``prompt_id`` used twice, no valid row at all, or no row left after filtering. Warnings (the
  file stays valid): unknown fields, one per field with its first line and count; ``strict`` makes them errors.
- A column named by the mapping (``--answer-key`` ..., ``data.*``) that no record holds (a misspelt nested key
  such as ``reward_model.groundtruth``) is an error naming the keys there are
  (:class:`~stream_rl.prompts.layouts.MappedKeys`).
- With a reward plan (``CheckOptions.reward``), the kept rows are checked against the reward that will score them
  (:mod:`stream_rl.prompts.reward_fit`): answers a verifier needs, routes, fall-through to the default.
- Problems and dropped rows name lines and ids, never prompt text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from stream_rl.prompts.clean import (
    CheckOptions, Dropped, Stats, apply_filters, compute_stats, deduplicate, duplicate_ids,
)
from stream_rl.prompts.layouts import Layout, MappedKeys, Mapping, detect_layout, plain_record, unknown_columns
from stream_rl.prompts.render import RenderError
from stream_rl.prompts.reward_fit import reward_problems
from stream_rl.prompts.schema import Problem, PromptFileError, PromptRow, row_from_record
from stream_rl.prompts.sources import columns, file_format, iter_records

UNITS = {"jsonl": "line", "parquet": "row", "hf": "row", "reasoning-gym": "row", "verifiers": "row"}
"""What a problem's number counts in each format."""

SHOWN_ERRORS = 10
"""How many errors an exception message or the load command names before summarising the rest."""


@dataclass
class PromptReport:
    """Everything known about one prompt file after :func:`check_prompt_file`."""

    path: Path
    format: str
    rows: list[PromptRow]  # kept rows, in file order
    problems: list[Problem]
    dropped: list[Dropped]
    stats: Stats
    options: CheckOptions = field(repr=False, default_factory=CheckOptions)
    layout: Layout | None = None

    @property
    def unit(self) -> str:
        return UNITS[self.format]

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity != "error"]

    @property
    def valid(self) -> bool:
        return not self.errors

    def error_summary(self, limit: int = SHOWN_ERRORS) -> str:
        """The first ``limit`` errors, one per line, then how many more there are."""
        errors = self.errors
        lines = [p.render(self.path, self.unit) for p in errors[:limit]]
        if len(errors) > limit:
            lines.append(f"... and {len(errors) - limit} more errors (`stream-rl prompts validate` lists them)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"file": str(self.path), "format": self.format, "unit": self.unit, "valid": self.valid,
                "layout": self.layout.describe() if self.layout else None,
                "options": {"dedup": self.options.dedup, "min_chars": self.options.min_chars,
                            "max_chars": self.options.max_chars, "max_tokens": self.options.max_tokens,
                            "strict": self.options.strict},
                "stats": self.stats.to_dict(), "errors": [p.to_dict() for p in self.errors],
                "warnings": [p.to_dict() for p in self.warnings], "dropped": [d.to_dict() for d in self.dropped]}


def _listing(title: str, lines: list[str], limit: int) -> list[str]:
    if not lines:
        return []
    more = [f"  ... and {len(lines) - limit} more (--json lists all)"] if len(lines) > limit else []
    return [f"{title} ({len(lines)}):"] + [f"  {line}" for line in lines[:limit]] + more


def _summary_line(name: str, summary: dict[str, float] | None) -> str:
    if summary is None:
        return f"{name}: -"
    return f"{name}: " + ", ".join(f"{k} {v:.1f}" if k == "mean" else f"{k} {v}" for k, v in summary.items())


def render_report(report: PromptReport, limit: int = 20) -> str:
    """The report as text: verdict, counts, length summaries, then errors, warnings and dropped rows."""
    st = report.stats
    verdict = "valid" if report.valid else f"INVALID ({len(report.errors)} errors)"
    by_reason = ", ".join(f"{reason} {n}" for reason, n in sorted(st.dropped.items())) or "none"
    layout = f", layout {report.layout.name}" if report.layout else ""
    lines = [f"{report.path} ({report.format}{layout}): {verdict}",
             f"{report.unit}s read {st.rows}, valid {st.valid}, kept {st.kept}, unique texts {st.unique_texts}, "
             f"unique normalized {st.unique_normalized}",
             f"dropped: {by_reason}", _summary_line("characters (kept)", st.chars)]
    rendered = sum(row.conversational for row in report.rows)
    if rendered:
        lines.insert(2, f"rendered by the chat template: {rendered} conversational prompts (kept)")
    if st.tokens is not None:
        lines.append(_summary_line("tokens (kept)", st.tokens))
    unit = report.unit
    lines += _listing("errors", [p.render(report.path, unit) for p in report.errors], limit)
    lines += _listing("warnings", [p.render(report.path, unit) for p in report.warnings], limit)
    lines += _listing("dropped", [f"{unit} {d.line} ({d.prompt_id}): {d.reason}"
                                  + (f" of {unit} {d.of_line}" if d.of_line else "") + f" - {d.detail}"
                                  for d in report.dropped], limit)
    return "\n".join(lines)


def _parse(path: Path, fmt: str, opts: CheckOptions
           ) -> tuple[int, list[PromptRow], list[Problem], Layout, list[str]]:
    """Records read, valid rows, problems (unknown fields folded into one problem per field, a mapped key that no
    record has), the layout and the file's columns."""
    prefix = UNITS[fmt]
    file_columns = columns(path, fmt)  # its errors name the path already
    try:
        layout = detect_layout(file_columns, opts.mapping or Mapping())
    except PromptFileError as exc:
        raise PromptFileError(f"{path}: {exc}") from None
    read, rows, problems = 0, [], []
    unknown: dict[str, list[int]] = {}  # field -> [first line, count]
    mapped = MappedKeys(opts.mapping or Mapping())
    for number, record in iter_records(path, fmt):
        mapped.see(record)
        if isinstance(record, Problem):
            read += record.line > 0
            problems.append(record)
            continue
        read += 1
        if not isinstance(record, dict):
            problems.extend(row_from_record(record, number, "")[1])
            continue
        plain, names, tag_problems = plain_record(record, layout, number)
        row, row_problems = row_from_record(plain, number, f"{prefix}{number}", names)
        problems.extend(tag_problems + row_problems)
        if row is not None and not tag_problems:
            rows.append(row)
        for name in unknown_columns(record, layout):
            unknown.setdefault(name, [number, 0])[1] += 1
    severity = "error" if opts.strict else "warning"
    verdict = "not allowed with strict" if opts.strict else "ignored"
    used = ", ".join(sorted(layout.columns_used()))
    problems.extend(Problem(first, name, f"unknown field, {verdict} (in {count} {prefix}{'s' * (count > 1)}); "
                            f"read ({layout.name} layout): {used}", severity)
                    for name, (first, count) in unknown.items())
    problems.extend(mapped.problems(file_columns, prefix) if read else [])
    return read, rows, problems, layout, file_columns


def _render(rows: list[PromptRow], opts: CheckOptions, problems: list[Problem]) -> list[PromptRow]:
    """Rows with every conversational prompt rendered (text and ids); a row that cannot be is a problem."""
    chats = [row for row in rows if row.conversational]
    if not chats:
        return rows
    try:
        if opts.renderer is None:
            raise PromptFileError("conversational prompts (messages) need a tokenizer with a chat template: pass "
                                  "--tokenizer DIR or set producer.model_dir")
        renderer = opts.renderer()
    except PromptFileError as exc:
        first = chats[0]
        problems.append(Problem(first.line, first.prompt_field, f"{exc} ({len(chats)} conversational prompts)"))
        return [row for row in rows if not row.conversational]
    out = []
    for row in rows:
        if not row.conversational:
            out.append(row)
            continue
        try:
            text, ids = renderer.render(row.messages, row.tools)
        except RenderError as exc:
            problems.append(Problem(row.line, row.prompt_field, str(exc)))
            continue
        out.append(replace(row, text=text, prompt_token_ids=tuple(int(i) for i in ids)))
    return out


def _token_counts(rows: list[PromptRow], count: Callable[[str], int] | None,
                  problems: list[Problem]) -> list[int] | None:
    if count is None:
        return None
    counts = []
    for row in rows:
        if row.prompt_token_ids is not None:  # rendered: its ids are exactly what the policy reads
            counts.append(len(row.prompt_token_ids))
            continue
        try:
            counts.append(int(count(row.text)))
        except Exception as exc:  # a tokenizer's own error type; reported on the row, the check goes on
            problems.append(Problem(row.line, "text", f"the tokenizer rejects it ({type(exc).__name__})"))
            counts.append(0)
    return counts


def check_prompt_file(path: Path, options: CheckOptions | None = None) -> PromptReport:
    """Read and judge the whole file; :class:`PromptFileError` only when it is missing or of unknown format."""
    path, opts = Path(path), options or CheckOptions()
    fmt = file_format(path)
    read, valid, problems, layout, names = _parse(path, fmt, opts)
    valid = _render(valid, opts, problems)
    tokens = _token_counts(valid, opts.count_tokens, problems)
    if opts.dedup == "none":  # every id would reach the topic: two prompts must not share one
        problems.extend(Problem(row.line, "prompt_id", f"{row.prompt_id!r} already used at {UNITS[fmt]} {first}")
                        for row, first in duplicate_ids(valid))
    filtered, dropped = apply_filters(valid, opts, tokens)
    kept, duplicates = deduplicate(filtered, opts.dedup)
    problems.extend(reward_problems(kept, opts.reward, layout.answer_key, names, UNITS[fmt]))
    dropped = sorted(dropped + duplicates, key=lambda d: d.line)
    if not valid and not problems:
        problems.append(Problem(0, None, "no prompts"))
    elif valid and not kept:
        problems.append(Problem(0, None, f"every prompt was dropped ({len(dropped)} rows; see the dropped list)"))
    kept_tokens = None
    if tokens is not None:
        by_line = {row.line: n for row, n in zip(valid, tokens)}
        kept_tokens = [by_line[row.line] for row in kept]
    stats = compute_stats(read, valid, kept, dropped, kept_tokens)
    problems.sort(key=lambda p: (p.line, p.severity != "error"))
    return PromptReport(path, fmt, kept, problems, dropped, stats, opts, layout)


def read_prompt_file(path: Path, options: CheckOptions | None = None) -> list[PromptRow]:
    """The rows to publish from ``path``; :class:`PromptFileError` naming the first errors when it is invalid.

    Default options: no deduplication (a ``prompt_id`` used twice is an error) and no filter beyond emptiness,
    as ``stream-rl run`` loads its prompt file.
    """
    report = check_prompt_file(path, options or CheckOptions(dedup="none"))
    if not report.valid:
        raise PromptFileError(report.error_summary())
    return report.rows


def token_counter(tokenizer_dir: Path) -> Callable[[str], int]:
    """Counts a text's tokens as the producer feeds them (the tokenizer's defaults, special tokens included)."""
    from stream_rl.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    return lambda text: len(tokenizer(text)["input_ids"])
