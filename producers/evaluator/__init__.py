"""The evaluator role (``stream-rl evaluate``): held-out evaluation of policy versions as they are published.

Modules: :mod:`~producers.evaluator.config` (``EvalConfig``), :mod:`~producers.evaluator.step` (one policy on
every set, no Kafka), :mod:`~producers.evaluator.role` (the loop over the weights topic). It lives in the producers
role because it generates. Guarantees: importing this package imports neither torch nor Kafka clients.
"""
