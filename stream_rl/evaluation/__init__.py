"""Held-out evaluation, the core part: metrics (:mod:`~stream_rl.evaluation.metrics`), reward and answer
extraction helpers (:mod:`~stream_rl.evaluation.scoring`) and the evals ledger (:mod:`~stream_rl.evaluation.ledger`).
The role that generates lives in :mod:`evaluator`; the CLI in :mod:`stream_rl.cli.eval_cmd`.

Consumes/Produces/Guarantees: see each module.
"""
