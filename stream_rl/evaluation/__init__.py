"""Held-out evaluation, the core part: metrics (:mod:`~stream_rl.evaluation.metrics`), reward and answer
extraction helpers (:mod:`~stream_rl.evaluation.scoring`), which version is due next
(:mod:`~stream_rl.evaluation.schedule`), the evals ledger (:mod:`~stream_rl.evaluation.ledger`), the line on
held-out accuracy at the end of a run (:mod:`~stream_rl.evaluation.report`), and the trainer's keep-best
(:mod:`~stream_rl.evaluation.best`, fed from the evals topic by :mod:`~stream_rl.evaluation.feed`).
The role that generates is the evaluator (:mod:`evaluator`); the CLI is :mod:`stream_rl.cli.eval_cmd`.

Consumes/Produces/Guarantees: see each module.
"""
