"""The reward an agent's environment already gave, passed through the scorer unchanged.

Consumes: a rollout's metadata, where the gateway (:mod:`producers.gateway`) writes the reward an episode ended
with under :data:`REWARD_KEY` (a float as text).
Produces: :func:`episode_reward`, a reward function with the scorer's contract
(``stream_rl.rewards.given:episode_reward``), for ``scorer.reward_fn`` or a ``scorer.rewards`` route on
``reward_source = "agent"`` (docs/agents.md).
Guarantees: the value returned is exactly the one given; a rollout without one raises ``ValueError`` (the scorer
dead-letters it with that reason instead of guessing a reward).
"""

from __future__ import annotations

REWARD_KEY = "episode_reward"
"""Rollout metadata key holding the reward an agent's episode ended with (a float as text)."""


def episode_reward(prompt: str, response: str, answer: str | None, metadata: dict[str, str]) -> float:
    """The reward in ``metadata[REWARD_KEY]``."""
    value = metadata.get(REWARD_KEY)
    if value is None:
        raise ValueError(f"the rollout carries no agent reward (metadata[{REWARD_KEY!r}]): end its episode with a "
                         f"reward, or score it with another reward function")
    return float(value)
