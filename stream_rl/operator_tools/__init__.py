"""Operator tools that look at an environment, a running pipeline or a finished run from the outside.

Consumes: a resolved :class:`~stream_rl.config.StreamRLConfig` (``doctor``, ``status``), a run's topics or a run
directory (``report``, ``gc``, ``trace show``).
Produces: :mod:`stream_rl.operator_tools.doctor` (pre-launch checks, each a (name, status, detail, remedy) row; the
model directories' in :mod:`stream_rl.operator_tools.model_check`),
:mod:`stream_rl.operator_tools.status` and :mod:`~stream_rl.operator_tools.status_read` (``stream-rl status``: the
snapshot, and the reads of the topics it is built from), :mod:`stream_rl.operator_tools.report` (PNG plots, one
self-contained HTML page and a text summary of ``metrics.jsonl``), :mod:`stream_rl.operator_tools.replay` (records
as JSON, sample content redacted), :mod:`stream_rl.operator_tools.trace_view` (span trees from ``spans.jsonl``) and
:mod:`stream_rl.operator_tools.gc` (the plan and removal of old checkpoints, weight versions and run files).
Guarantees: importing this package imports neither torch nor matplotlib; the modules import them when used.
"""
