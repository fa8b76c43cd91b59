"""Rewards shared by the roles that score responses (the scorer, the evaluator).

- the contract and names: :mod:`.contract` (loading ``module:function``), :mod:`.names` (one registry of short
  names), :mod:`.routing` (by a prompt's metadata), :mod:`.settings` (reward-call and judge settings, declared once);
- built-in rewards: :mod:`.verifiers`, :mod:`.math_equal`, :mod:`.simple`, :mod:`.given` (an environment's own),
  :mod:`.sandbox` with :mod:`.jail` (``code_tests``), :mod:`.judge` (an LLM judge);
- calling them: :mod:`.calls` (deadlines, bounded concurrency), :mod:`.isolated` with :mod:`.isolated_worker`
  (worker processes), :mod:`.http`, :mod:`.server` and :mod:`.openrlhf` (reward servers and their protocols).

Consumes / Produces / Guarantees: those of the submodules; importing this package imports numpy only.
"""
