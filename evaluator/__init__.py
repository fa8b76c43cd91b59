"""The evaluator role (``stream-rl evaluate``): held-out evaluation of policy versions as they are published.

Modules: :mod:`~evaluator.config` (``EvalConfig``, the ``[eval]`` section), :mod:`~evaluator.step` (one policy on
every set, generated, scored and summarised, no Kafka), :mod:`~evaluator.role` (the loop over the weights topic).
A role of its own beside ``producers/`` and ``consumers/``: it generates with the producers' engines, config and
weights follower (the one import of another role the layer test allows), and only the CLI imports it.
Guarantees: importing this package imports neither torch nor Kafka clients.
"""
