"""Turning checked prompt rows into Prompt records, epoch by epoch, and publishing them.

Consumes: :class:`~stream_rl.prompts.schema.PromptRow` lists (already checked), epochs, group size and a seed.
Produces: :class:`schemas.Prompt` messages, one per (prompt, epoch), and their records on the run's prompts topic,
keyed by ``prompt_id`` (so every epoch and attempt of a prompt shares one partition). A conversational prompt is
published with ``messages`` as loaded, ``text`` = its rendering and ``prompt_token_ids`` = the rendered ids (the
producer generates from exactly those ids); a plain prompt with ``text`` only (the producer tokenises it). The
wire's messages hold strings only: an assistant's ``tool_calls`` travel as compact JSON, and a row's ``tools`` are
in the rendered text and ids, not in the record (a multi-turn environment that re-renders the conversation would
render it without them).
Guarantees: ``group_size`` is bounded (``1..schemas.MAX_GROUP_SIZE``) before anything is built; all records are
built and validated (``schemas.validate``) before the first one is sent; epoch ``e``
is shuffled with ``random.Random(seed + e)`` (or kept in file order with ``shuffle=False``), so the same rows,
seed and epochs always give the same sequence; :func:`publish_prompts` returns only after the broker
acknowledged every record (a failed send raises).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import numpy as np

from schemas import MAX_GROUP_SIZE, Prompt, SchemaError, validate
from stream_rl.prompts.schema import PromptFileError, PromptRow


def prompt_messages(rows: Sequence[PromptRow], epochs: int, group_size: int, seed: int = 0,
                    shuffle: bool = True) -> list[Prompt]:
    """Prompt records for ``epochs`` passes over ``rows``: epoch 0 first, each epoch in its own shuffled order."""
    if epochs < 1:
        raise PromptFileError(f"epochs must be >= 1, got {epochs}")
    if not 1 <= group_size <= MAX_GROUP_SIZE:
        raise PromptFileError(f"group_size (--group-size / run.group_size) must be between 1 and {MAX_GROUP_SIZE} "
                              f"samples per prompt, got {group_size}")
    for row in rows:
        if row.conversational and row.prompt_token_ids is None:
            raise PromptFileError(f"line {row.line}: conversational prompt not rendered (check the file with a "
                                  "renderer first)")
        try:
            validate(_prompt(row, 0, group_size))
        except SchemaError as exc:
            raise PromptFileError(f"line {row.line}: {exc}") from None
    out = []
    for epoch in range(epochs):
        order = list(rows)
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        out.extend(_prompt(r, epoch, group_size) for r in order)
    return out


def _prompt(row: PromptRow, epoch: int, group_size: int) -> Prompt:
    """One record; a conversational row carries its messages, rendered text and rendered ids."""
    ids = None if row.prompt_token_ids is None else np.asarray(row.prompt_token_ids, dtype=np.int32)
    messages = None if row.messages is None else [_wire_message(m) for m in row.messages]
    return Prompt(prompt_id=row.prompt_id, epoch=epoch, text=row.text, answer=row.answer, metadata=dict(row.metadata),
                  group_size=group_size, prompt_token_ids=ids, messages=messages)


def _wire_message(message: dict) -> dict[str, str]:
    """A message as ``Prompt.messages`` carries it (strings only): an assistant's ``tool_calls`` as compact JSON."""
    return {key: value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)
            for key, value in message.items()}


def publish_prompts(transport, messages: Sequence[Prompt]) -> int:
    """Send ``messages`` keyed by prompt_id and wait for the broker's acknowledgements; returns how many."""
    sink = transport.sink()
    try:
        for msg in messages:
            sink.send(transport.names.prompts, msg, key=msg.prompt_id)
        sink.flush()
    finally:
        sink.close()
    return len(messages)
