"""Rewards shared by the roles that score responses (the scorer, the evaluator): the reward-function contract
(:mod:`.contract`), the built-in verifiers (:mod:`.verifiers`) and routing by metadata (:mod:`.routing`).

Consumes / Produces / Guarantees: those of the submodules; importing this package imports numpy only.
"""
