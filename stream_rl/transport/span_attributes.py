"""Span attributes of a message: the numbers an operator needs to follow a rollout, never its text.

Consumes: a schema message (``Rollout``, ``ScoredRollout``; anything else gives no attributes).
Produces: a flat ``{str: int | float | str}`` dict for :meth:`stream_rl.transport.tracing.Tracing.send_span`:
``stream_rl.rollout_id``, ``stream_rl.group_id``, ``stream_rl.policy_version.min`` / ``.max`` (over the response
tokens), ``stream_rl.prompt_tokens``, ``stream_rl.response_tokens``; a scored rollout adds ``stream_rl.reward``
(when finite).
Guarantees: pure, and only ids, counts, versions and the reward are read: ``prompt_text``, ``response_text``,
``answer`` and ``metadata`` never reach a span (tests/integration/test_status.py checks a rollout whose every text field is a
sentinel). Ids are the deterministic ids of :mod:`schemas.ids` (prompt id, epoch, sample index), not sample text.
"""

from __future__ import annotations

import math
from typing import Any

ROLLOUT_ID = "stream_rl.rollout_id"
GROUP_ID = "stream_rl.group_id"
VERSION_MIN = "stream_rl.policy_version.min"
VERSION_MAX = "stream_rl.policy_version.max"
PROMPT_TOKENS = "stream_rl.prompt_tokens"
RESPONSE_TOKENS = "stream_rl.response_tokens"
REWARD = "stream_rl.reward"


def _rollout_attributes(rollout: Any) -> dict[str, Any]:
    versions = rollout.token_policy_versions
    return {
        ROLLOUT_ID: rollout.rollout_id,
        GROUP_ID: rollout.group_id,
        VERSION_MIN: int(versions.min()) if versions.size else -1,
        VERSION_MAX: int(versions.max()) if versions.size else -1,
        PROMPT_TOKENS: int(rollout.prompt_token_ids.shape[0]),
        RESPONSE_TOKENS: int(rollout.response_token_ids.shape[0]),
    }


def span_attributes(message: Any) -> dict[str, Any]:
    """The span attributes of ``message`` (empty for kinds that carry no rollout)."""
    kind = getattr(message, "KIND", None)
    if kind == "rollout":
        return _rollout_attributes(message)
    if kind == "scored_rollout":
        attrs = _rollout_attributes(message.rollout)
        if isinstance(message.reward, (int, float)) and math.isfinite(message.reward):
            attrs[REWARD] = float(message.reward)
        return attrs
    return {}
