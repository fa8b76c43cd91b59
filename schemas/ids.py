"""Identifier rules and the deterministic rollout and group ids.

Consumes: prompt ids, epochs and sample indices. Produces: ``group_id_for(prompt_id, epoch)`` and
``rollout_id_for(prompt_id, epoch, sample_index)`` (``SchemaError`` naming the bad part otherwise), and the
patterns every id and topic name must match.

Guarantees:
- A rollout id depends only on (prompt id, epoch, sample index), never on the attempt, the producer or the time:
  a sample regenerated after a stale drop gets the same id as the one it replaces, so the trainer's dedup ledger
  recognises it. The group id depends only on (prompt id, epoch), so every attempt of a group shares one Kafka key
  and lands on one partition.
- The mapping is injective: the last two ``:``-separated parts of a rollout id are decimal integers and everything
  before them is the prompt id (which may itself contain ``:``).
- Derived ids always match :data:`ID_PATTERN`: prompt ids are limited to :data:`PROMPT_ID_MAX_LEN` characters and
  the suffix adds at most 2 * (1 + 19) characters for int64 epoch and index.
"""

from __future__ import annotations

import numbers
import re

from schemas.errors import SchemaError

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,254}$")
"""Any id (rollout, group, producer, scorer, trainer, consumer): 1-255 ASCII chars, starting alphanumeric."""

PROMPT_ID_MAX_LEN = 200
"""Prompt ids match :data:`ID_PATTERN` and are at most this long, leaving room for the derived suffixes."""

TOPIC_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
"""A legal Kafka topic name."""

SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
"""A SHA-256 digest as 64 lowercase hex characters."""

_ID_MATCH = ID_PATTERN.fullmatch


def id_problem(value: object, max_len: int = 255) -> str | None:
    """Why ``value`` is not a well-formed id, or ``None`` when it is."""
    if type(value) is str and len(value) <= max_len and _ID_MATCH(value) is not None:
        return None  # the common case, one compiled match; the checks below say what is wrong otherwise
    if not isinstance(value, str):
        return f"expected str, got {type(value).__name__}"
    if len(value) > max_len:
        return f"longer than {max_len} characters ({len(value)})"
    if not ID_PATTERN.fullmatch(value):
        return f"malformed id {value!r} (must match {ID_PATTERN.pattern})"
    return None


def _require_index(name: str, value: object) -> int:
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise SchemaError(name, f"must be a non-negative int, got {value!r:.40}")
    return int(value)


def group_id_for(prompt_id: str, epoch: int) -> str:
    """The group id of every sample of ``prompt_id`` in ``epoch``: ``"{prompt_id}:{epoch}"``."""
    problem = id_problem(prompt_id, PROMPT_ID_MAX_LEN)
    if problem is not None:
        raise SchemaError("prompt_id", problem)
    return f"{prompt_id}:{_require_index('epoch', epoch)}"


def rollout_id_for(prompt_id: str, epoch: int, sample_index: int) -> str:
    """The rollout id of one sample: ``"{prompt_id}:{epoch}:{sample_index}"`` (same for every attempt)."""
    return f"{group_id_for(prompt_id, epoch)}:{_require_index('sample_index', sample_index)}"


def is_decimal(text: str) -> bool:
    """Whether ``text`` is a canonical non-negative decimal integer (``"0"``, ``"12"``; not ``"012"``, ``"+1"``)."""
    return text.isascii() and text.isdigit() and str(int(text)) == text


def is_group_id(text: object) -> bool:
    """Whether ``text`` has the form of ``group_id_for(prompt_id, epoch)``: a prompt id, ``:``, an epoch."""
    if not isinstance(text, str):
        return False
    prompt_id, _, epoch = text.rpartition(":")
    return id_problem(prompt_id, PROMPT_ID_MAX_LEN) is None and is_decimal(epoch)
