"""reasoning-gym datasets as a prompt source, scored by reasoning-gym's own verifier of that dataset.

Consumes: a source spec ``reasoning-gym:NAME?size=N&seed=S&KEY=VALUE...`` (where a prompt file's path goes:
``run.prompts_file``, ``stream-rl prompts load/validate``); ``NAME`` is a reasoning-gym dataset
(``reasoning_gym.factory.DATASETS``), ``size`` (default 100) and ``seed`` (default 0) its size and seed, any other
key a field of that dataset's config (its value read as JSON when it parses, else as a string: ``max_terms=3``).
Produces: per entry, a plain-layout record (:mod:`stream_rl.prompts.sources` yields it with its 1-based row)::

    prompt_id  "rg-NAME-SEED-INDEX"
    text       the entry's question + ANSWER_FORMAT
    answer     str(entry["answer"])
    metadata   data_source  "reasoning_gym/NAME"
               rg_dataset, rg_size, rg_seed, rg_index, rg_config (the extra keys, JSON)
               rg_question  sha256 of the entry's question, first 16 hex digits

and the ``reasoning_gym`` reward (:func:`reasoning_gym_reward`, a short name of :mod:`stream_rl.rewards.names`):
it rebuilds the same dataset from the metadata, takes entry ``rg_index`` and returns
``dataset.score_answer(extracted, entry)``, the dataset's own verifier (``extracted``: the last
``<answer>...</answer>`` of the response, or the whole stripped response when it has none).

Guarantees:
- Entries are a pure function of (name, size, seed, config): the producer side and the scorer side rebuild the
  same one, and a rebuilt entry whose question digest differs from ``rg_question`` (another reasoning-gym
  version on the scorer) fails that rollout with the reason instead of scoring it against another question.
- A rollout without the ``rg_*`` metadata, an unknown dataset, or a score that is not a finite number fails with
  the reason (the scorer dead-letters it). Rebuilt datasets are cached (at most :data:`CACHED` specs).
- A bad spec (unknown dataset, a config key the dataset does not take, size < 1) is a
  :class:`~stream_rl.prompts.schema.PromptFileError` naming it, before anything is published.
- ``reasoning_gym`` is imported only here, when a spec or the reward is used; without it, :class:`HubMissing`.
- ``score_answer`` is the hub's code: run it under the scorer's deadline (``scorer.reward_timeout_s``) and, for a
  stall-proof scorer, in worker processes (``scorer.reward_isolation = "process"``), as any reward.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl

from stream_rl.hubs import HubMissing

PREFIX = "reasoning-gym:"
ANSWER_FORMAT = "\nGive only the final answer inside <answer></answer>."
"""Appended to every question: reasoning-gym's verifiers compare the extracted answer, not the reasoning."""
CACHED = 16
MAX_SIZE = 1_000_000
_ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_KEYS = ("rg_dataset", "rg_size", "rg_seed", "rg_index", "rg_config", "rg_question")


class SpecError(ValueError):
    """A ``reasoning-gym:`` spec that names no usable dataset; ``str()`` says why."""


def parse_spec(source: object) -> tuple[str, int, int, dict]:
    """``(name, size, seed, config)`` of a spec; :class:`SpecError` naming what is wrong."""
    body = str(source)[len(PREFIX):]
    name, _, query = body.partition("?")
    if not name:
        raise SpecError(f"{source}: no dataset name (write reasoning-gym:NAME?size=N&seed=S)")
    config: dict[str, Any] = {key: _value(value) for key, value in parse_qsl(query, keep_blank_values=True)}
    try:
        size, seed = int(config.pop("size", 100)), int(config.pop("seed", 0))
    except (TypeError, ValueError):
        raise SpecError(f"{source}: size and seed must be integers") from None
    if not 1 <= size <= MAX_SIZE:
        raise SpecError(f"{source}: size must be between 1 and {MAX_SIZE}, got {size}")
    return name, size, seed, config


def records(source: object) -> Iterator[tuple[int, dict]]:
    """``(row, record)`` for every entry of the spec's dataset, in index order (module docstring)."""
    name, size, seed, config = parse_spec(source)
    dataset = _dataset(name, size, seed, json.dumps(config, sort_keys=True))
    for index in range(size):
        entry = dataset[index]
        yield index + 1, {
            "prompt_id": f"rg-{name}-{seed}-{index}",
            "text": str(entry["question"]) + ANSWER_FORMAT,
            "answer": None if entry.get("answer") is None else str(entry["answer"]),
            "metadata": {"data_source": f"reasoning_gym/{name}", "rg_dataset": name, "rg_size": str(size),
                         "rg_seed": str(seed), "rg_index": str(index),
                         "rg_config": json.dumps(config, sort_keys=True), "rg_question": _digest(entry)},
        }


def extract_answer(response: str) -> str:
    """The last ``<answer>...</answer>`` of ``response`` (stripped), or the whole stripped response."""
    found = _ANSWER.findall(response)
    return (found[-1] if found else response).strip()


def reasoning_gym_reward(prompt: str, response: str, answer: str | None, metadata: dict[str, str]) -> float:
    """reasoning-gym's own ``score_answer`` for the rollout's entry (module docstring); ValueError with the
    reason when the metadata does not name one."""
    missing = [key for key in _KEYS if key not in metadata]
    if missing:
        raise ValueError(f"not a reasoning-gym prompt: metadata has no {', '.join(missing)} (load the prompts "
                         f"from a reasoning-gym:NAME source)")
    try:
        size, seed, index = int(metadata["rg_size"]), int(metadata["rg_seed"]), int(metadata["rg_index"])
    except ValueError:
        raise ValueError("reasoning-gym metadata rg_size, rg_seed, rg_index must be integers") from None
    if not 0 <= index < size <= MAX_SIZE:
        raise ValueError(f"reasoning-gym metadata: rg_index {index} outside a dataset of {size}")
    dataset = _dataset(metadata["rg_dataset"], size, seed, metadata["rg_config"])
    entry = dataset[index]
    if _digest(entry) != metadata["rg_question"]:
        raise ValueError(f"reasoning-gym {metadata['rg_dataset']} entry {index} is not the question that was "
                         f"asked (another reasoning-gym version on the scorer?)")
    return float(dataset.score_answer(extract_answer(response), entry))


def _value(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _digest(entry: dict) -> str:
    return hashlib.sha256(str(entry["question"]).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=CACHED)
def _dataset(name: str, size: int, seed: int, config_json: str):
    """The dataset ``name`` built by reasoning-gym (cached per spec); SpecError for an unknown name or config."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise HubMissing("reasoning-gym", "a reasoning-gym: prompt source or the reasoning_gym reward") from None
    if name not in DATASETS:
        close = sorted(n for n in DATASETS if name[:4] in n)[:8]
        raise SpecError(f"reasoning-gym has no dataset {name!r}" + (f" (close: {', '.join(close)})" if close else
                                                                   f" ({len(DATASETS)} datasets)"))
    try:
        config = json.loads(config_json)
        if not isinstance(config, dict):
            raise SpecError(f"reasoning-gym config must be an object, got {config_json[:80]!r}")
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **config)
    except SpecError:
        raise
    except (TypeError, ValueError, AssertionError) as exc:
        raise SpecError(f"reasoning-gym dataset {name!r} refuses its config {config_json}: "
                        f"{type(exc).__name__}: {str(exc)[:200]}") from None
