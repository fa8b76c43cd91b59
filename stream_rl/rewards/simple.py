"""Reusable rule-based rewards, by short name everywhere (:mod:`stream_rl.rewards.names`) or as
``stream_rl.rewards.simple:<name>`` (``consumers.scorer.builtin_rewards:<name>`` still loads).

Consumes: a prompt, a response, the reference answer and the prompt's string metadata.
Produces: a float reward in [0, 1] (see :mod:`stream_rl.rewards.contract` for the contract).
Guarantees: pure functions of their arguments; a missing reference answer raises ``ValueError`` (the scorer then
dead-letters the record with that reason instead of guessing a reward).

Responses are compared after :func:`strip_response`: trailing end-of-sequence / padding markers (``<eos>``,
``</s>``, ``<|endoftext|>``, ``<|im_end|>``, ``<pad>``) and surrounding whitespace are removed, since engines
decode with or without special tokens.
"""

from __future__ import annotations

import re

from stream_rl.rewards.verifiers import strip_response

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")

REWARDS = ("exact_match", "contains_answer", "last_number_match")
"""The rewards of this module, by their short names (:data:`stream_rl.rewards.names.BUILTIN_NAMES` lists every
built-in reward's); ``strip_response`` is the verifiers', re-exported here."""

__all__ = ["REWARDS", "contains_answer", "exact_match", "last_number_match", "strip_response"]


def _require_answer(answer: str | None) -> str:
    if answer is None:
        raise ValueError("this reward needs the prompt's reference answer, and the rollout has none")
    return answer.strip()


def exact_match(prompt: str, response: str, answer: str | None, metadata: dict[str, str]) -> float:
    """1.0 when the stripped response equals the stripped answer, else 0.0."""
    return 1.0 if strip_response(response) == _require_answer(answer) else 0.0


def contains_answer(prompt: str, response: str, answer: str | None, metadata: dict[str, str]) -> float:
    """1.0 when the answer appears anywhere in the response (lenient; for chatty policies), else 0.0."""
    return 1.0 if _require_answer(answer) in response else 0.0


def last_number_match(prompt: str, response: str, answer: str | None, metadata: dict[str, str]) -> float:
    """1.0 when the last number in the response equals the answer numerically (``"12.0"`` == ``"12"``), else 0.0."""
    expected = float(_require_answer(answer))
    numbers = _NUMBER.findall(strip_response(response))
    return 1.0 if numbers and float(numbers[-1]) == expected else 0.0
