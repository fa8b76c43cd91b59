"""The first prompts of a checked file as the producer will read them (``stream-rl prompts validate --show N``).

Consumes: the kept rows of a :class:`~stream_rl.prompts.check.PromptReport` (file order) and the tokenizer source
the loader used (:class:`~stream_rl.prompts.render.TokenizerSource`).
Produces: per prompt a :class:`Shown` (id, line, data source, answer, token ids, the text those ids decode to) and
their text rendering, one header line then the text exactly.

Guarantees: the ids are the ones the producer generates from (:func:`producers.step.prompt_tokens`): a
conversational prompt's rendered ids, else ``tokenizer(text)["input_ids"]`` with the tokenizer's defaults (a BOS
it adds included); the text shown is those ids decoded with special tokens kept and no clean-up, so a marker the
template or the tokenizer adds is visible. Without a loadable tokenizer the published text is shown, saying why.
This is the one place sample text is printed on purpose: the user asked for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stream_rl.prompts.render import TokenizerSource
from stream_rl.prompts.schema import PromptFileError, PromptRow


@dataclass(frozen=True)
class Shown:
    """One prompt as the producer reads it; ``token_ids`` None when no tokenizer could be loaded (``note`` why)."""

    prompt_id: str
    line: int
    data_source: str | None
    answer: str | None
    text: str
    token_ids: list[int] | None
    note: str = ""

    def to_dict(self) -> dict:
        return {"prompt_id": self.prompt_id, "line": self.line, "data_source": self.data_source,
                "answer": self.answer, "text": self.text, "token_ids": self.token_ids}


def shown_prompts(rows: Sequence[PromptRow], n: int, source: TokenizerSource) -> list[Shown]:
    """The first ``n`` rows as :class:`Shown` (module docstring)."""
    why = ""
    try:
        tokenizer = source.get() if rows[:n] else None
    except PromptFileError as exc:
        tokenizer, why = None, str(exc)
    out = []
    for row in rows[:n]:
        source_tag = row.metadata.get("data_source")
        if tokenizer is None:
            out.append(Shown(row.prompt_id, row.line, source_tag, row.answer, row.text, None,
                             f"not tokenized: {why}"))
            continue
        ids = list(row.prompt_token_ids) if row.prompt_token_ids is not None else \
            list(tokenizer(row.text)["input_ids"])
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        out.append(Shown(row.prompt_id, row.line, source_tag, row.answer, text, [int(i) for i in ids]))
    return out


def render_shown(shown: Sequence[Shown], unit: str, total: int) -> str:
    """Each prompt: ``--- prompt 1 of N: id ... (row 3), data_source ..., answer ..., 21 tokens ---``, then its
    text exactly as decoded."""
    blocks = []
    for index, item in enumerate(shown, start=1):
        tokens = f"{len(item.token_ids)} tokens" if item.token_ids is not None else item.note
        blocks.append(f"--- prompt {index} of {total}: id {item.prompt_id} ({unit} {item.line}), data_source "
                      f"{item.data_source!r}, answer {item.answer!r}, {tokens} ---\n{item.text}")
    return "\n".join(blocks)
