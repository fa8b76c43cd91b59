"""The prompt loader's options from the ``[data]`` section, the command's flags and the policy's tokenizer.

Consumes: :class:`stream_rl.config.data.DataConfig`, the loader's flags (a flag overrides its ``data.*`` field),
the ``--tokenizer`` directory and the policy's directory (``producer.model_dir`` as the command resolved it).
Produces: :class:`~stream_rl.prompts.clean.CheckOptions` with the column mapping, the token counter, the renderer
factory and the reward plan the rows are checked against (:mod:`stream_rl.prompts.reward_fit`), for
``stream-rl prompts validate | load`` and ``stream-rl run``.
Guarantees: the tokenizer is ``--tokenizer`` when given, else the policy's; it is loaded here only when tokens are
counted (``--tokenizer``, ``--max-tokens`` or ``data.max_prompt_tokens``), so a bad directory is one
:class:`PromptFileError` before the file is read, else lazily by the renderer, only for a file with messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from stream_rl.config.data import DataConfig
from stream_rl.prompts.clean import CheckOptions
from stream_rl.prompts.layouts import Mapping
from stream_rl.prompts.render import TokenizerSource, chat_renderer
from stream_rl.prompts.reward_fit import RewardPlan

NO_TOKENIZER = "pass --tokenizer DIR or set producer.model_dir"


def mapping_of(data: DataConfig, prompt_key: str | None = None, answer_key: str | None = None,
               id_key: str | None = None, metadata_keys: Sequence[str] | None = None) -> Mapping:
    """The explicit column mapping: each flag given, else its ``data.*`` field, else None (detected)."""
    keys = metadata_keys if metadata_keys is not None else data.metadata_keys
    return Mapping(prompt_key or data.prompt_key, answer_key or data.answer_key, id_key or data.id_key,
                   None if keys is None else tuple(keys))


def tokenizer_source(tokenizer: Path | None, policy_dir: Path | None) -> TokenizerSource:
    """``--tokenizer`` when given, else the policy's directory, else none (an error only if one is needed)."""
    if tokenizer is not None:
        return TokenizerSource(Path(tokenizer), "--tokenizer")
    if policy_dir is not None:
        return TokenizerSource(Path(policy_dir), "producer.model_dir (the policy's tokenizer)")
    return TokenizerSource(None, NO_TOKENIZER)


def check_options(data: DataConfig, *, tokenizer: Path | None = None, policy_dir: Path | None = None,
                  dedup: str = "none", min_chars: int = 1, max_chars: int | None = None,
                  max_tokens: int | None = None, strict: bool = False, mapping: Mapping | None = None,
                  reward: RewardPlan | None = None) -> CheckOptions:
    """:class:`CheckOptions` for the loader; ``max_tokens`` None falls back to ``data.max_prompt_tokens``.
    :class:`PromptFileError` for a tokenizer that is needed now and cannot be loaded; ValueError for bad options."""
    source = tokenizer_source(tokenizer, policy_dir)
    limit = max_tokens if max_tokens is not None else data.max_prompt_tokens
    counter = None
    if tokenizer is not None or (limit is not None and source.directory is not None):
        source.get()  # a bad directory fails here, naming it, before the file is read
        counter = source.count
    template, kwargs = data.chat_template, dict(data.chat_template_kwargs)
    return CheckOptions(dedup=dedup, min_chars=min_chars, max_chars=max_chars, max_tokens=limit,
                        count_tokens=counter, strict=strict, mapping=mapping or mapping_of(data),
                        renderer=lambda: chat_renderer(source, template, kwargs), reward=reward)
