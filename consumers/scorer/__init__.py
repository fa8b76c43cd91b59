"""The scorer role (``stream-rl score``): rewards and reference log-probabilities for every rollout.

Modules: ``config`` (:class:`ScorerConfig`, ``cfg.scorer``), ``rewards`` (``module:function`` reward references),
``builtin_rewards`` (reusable rule-based rewards), ``reference`` (frozen reference log-probs), ``reward_model``
(sequence-classifier scores), ``step`` (the pure, Kafka-free step), ``loop`` (:func:`run_scorer`), ``rescore``
(``stream-rl rescore``: a run's logged rollouts scored again into a new run).
Importing this package imports only the config: torch, transformers and kafka load with the modules that need them.
"""

from consumers.scorer.config import DEFAULT_REWARD_FN, ScorerConfig

__all__ = ["DEFAULT_REWARD_FN", "ScorerConfig"]
