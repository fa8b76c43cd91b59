"""The scorer role (``stream-rl score``): rewards and reference log-probabilities for every rollout.

Modules: ``config`` (:class:`ScorerConfig`, ``cfg.scorer``), ``scoring`` (the pure, Kafka-free step:
:func:`~consumers.scorer.scoring.score_rollouts`), ``scorer`` (the loop, :func:`~consumers.scorer.scorer.run_scorer`,
one batch or several in flight), ``services`` (every reward of a batch called through the core's reward executor:
rule-based, routed, reward server, judge), ``reference`` (frozen reference log-probs), ``reward_model``
(sequence-classifier scores), ``rescore`` (``stream-rl rescore``: a run's logged rollouts scored again into a new
run), ``builtin_rewards`` (an alias kept so that ``consumers.scorer.builtin_rewards:<name>`` in existing configs
still loads; the rewards themselves, their names, routing, calls and settings live in :mod:`stream_rl.rewards`).
Importing this package imports only the config: torch, transformers and kafka load with the modules that need them.
"""

from consumers.scorer.config import DEFAULT_REWARD_FN, ScorerConfig

__all__ = ["DEFAULT_REWARD_FN", "ScorerConfig"]
