"""Operator tools that look at an environment or a finished run from the outside.

Consumes: a resolved :class:`~stream_rl.config.StreamRLConfig` (``doctor``) or a run directory (``report``).
Produces: :mod:`stream_rl.operator_tools.doctor` (pre-launch checks, each a (name, status, detail, remedy) row; the
model directories' in :mod:`stream_rl.operator_tools.model_check`) and
:mod:`stream_rl.operator_tools.report` (PNG plots, one self-contained HTML page and a text summary of ``metrics.jsonl``);
:mod:`stream_rl.operator_tools.gc` (the plan and removal of old checkpoints, weight versions and run files).
Guarantees: importing this package imports neither torch nor matplotlib; the modules import them when used.
"""
