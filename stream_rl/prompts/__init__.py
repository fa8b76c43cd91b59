"""Prompt data: read, check, render, clean and publish prompt files (JSON lines, Parquet, ``datasets`` dirs).

Consumes: a prompt file, one record per line (JSON lines) or row (Parquet, a ``save_to_disk`` directory) in the
plain layout (``text`` or ``messages``, ``prompt_id``, ``answer``, ``metadata``), verl's or TRL's, or mapped by
flags; the schema is in :mod:`stream_rl.prompts.schema`, the layouts in :mod:`stream_rl.prompts.layouts`, both in
``docs/prompts.md``. Conversational prompts are rendered with the policy's chat template
(:mod:`stream_rl.prompts.render`).
Produces: a :class:`PromptReport` (problems by line, dropped rows by reason, statistics) and
:class:`schemas.Prompt` records on the run's prompts topic, one per (prompt, epoch).
Guarantees: the whole file is checked before anything is published, and nothing is published when it has an
error; deduplication keeps first occurrences; shuffling is seeded per epoch; no report or error quotes prompt text.

Modules: :mod:`~stream_rl.prompts.sources` (formats), :mod:`~stream_rl.prompts.layouts` (which columns hold
what), :mod:`~stream_rl.prompts.schema` (one record), :mod:`~stream_rl.prompts.tools` (tool calls and tools),
:mod:`~stream_rl.prompts.options` (the loader's options), :mod:`~stream_rl.prompts.templates` and
:mod:`~stream_rl.prompts.render` (chat templates), :mod:`~stream_rl.prompts.clean` (filters, dedup, stats),
:mod:`~stream_rl.prompts.check` (a whole file), :mod:`~stream_rl.prompts.reward_fit` (the file against the reward
that scores it), :mod:`~stream_rl.prompts.show` (the first prompts as the producer reads them),
:mod:`~stream_rl.prompts.publish` (records and the topic).
"""

from stream_rl.prompts.check import PromptReport, check_prompt_file, read_prompt_file, render_report, token_counter
from stream_rl.prompts.clean import DEDUP_MODES, CheckOptions, Dropped, Stats, normalize_text
from stream_rl.prompts.layouts import LAYOUTS, Layout, Mapping, detect_layout, flatten_tags
from stream_rl.prompts.options import check_options, mapping_of
from stream_rl.prompts.publish import prompt_messages, publish_prompts
from stream_rl.prompts.render import ChatRenderer, RenderError, TokenizerSource, chat_renderer
from stream_rl.prompts.reward_fit import RewardPlan
from stream_rl.prompts.schema import Problem, PromptFileError, PromptRow
from stream_rl.prompts.sources import FORMATS

__all__ = [
    "DEDUP_MODES", "FORMATS", "LAYOUTS", "ChatRenderer", "CheckOptions", "Dropped", "Layout", "Mapping", "Problem",
    "PromptFileError", "PromptReport", "PromptRow", "RenderError", "RewardPlan", "Stats", "TokenizerSource",
    "chat_renderer", "check_options", "check_prompt_file", "detect_layout", "flatten_tags", "mapping_of",
    "normalize_text", "prompt_messages", "publish_prompts", "read_prompt_file", "render_report", "token_counter",
]
