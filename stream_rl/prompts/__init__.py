"""Prompt data: read, check, clean and publish prompt files (JSON lines or Parquet).

Consumes: a prompt file, one record per line (JSON lines) or row (Parquet) with ``text`` (required),
``prompt_id``, ``answer`` and ``metadata`` (optional); the schema is in :mod:`stream_rl.prompts.schema` and
``docs/prompts.md``.
Produces: a :class:`PromptReport` (problems by line, dropped rows by reason, statistics) and
:class:`schemas.Prompt` records on the run's prompts topic, one per (prompt, epoch).
Guarantees: the whole file is checked before anything is published, and nothing is published when it has an
error; deduplication keeps first occurrences; shuffling is seeded per epoch; no report or error quotes prompt text.

Modules: :mod:`~stream_rl.prompts.sources` (formats), :mod:`~stream_rl.prompts.schema` (one record),
:mod:`~stream_rl.prompts.clean` (filters, dedup, stats), :mod:`~stream_rl.prompts.check` (a whole file),
:mod:`~stream_rl.prompts.publish` (records and the topic).
"""

from stream_rl.prompts.check import PromptReport, check_prompt_file, read_prompt_file, render_report, token_counter
from stream_rl.prompts.clean import DEDUP_MODES, CheckOptions, Dropped, Stats, normalize_text
from stream_rl.prompts.publish import prompt_messages, publish_prompts
from stream_rl.prompts.schema import Problem, PromptFileError, PromptRow
from stream_rl.prompts.sources import FORMATS

__all__ = [
    "DEDUP_MODES", "FORMATS", "CheckOptions", "Dropped", "Problem", "PromptFileError", "PromptReport", "PromptRow",
    "Stats", "check_prompt_file", "normalize_text", "prompt_messages", "publish_prompts", "read_prompt_file",
    "render_report", "token_counter",
]
