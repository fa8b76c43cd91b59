"""Memory and placement planner for ``stream-rl plan`` (formulas and sources in ``docs/planner.md``).

- :mod:`~stream_rl.planner.model_size`: parameter counts from a Hugging Face ``config.json``.
- :mod:`~stream_rl.planner.memory`: one pure function per memory formula, in bytes.
- :mod:`~stream_rl.planner.inputs`: :class:`PlanInputs`, the validated question.
- :mod:`~stream_rl.planner.plan`: :class:`PlanInputs` -> :func:`make_plan` -> :class:`Plan` (with the trainer's
  :class:`TrainerLaunch`).
- :mod:`~stream_rl.planner.layout`: the ``stream-rl run`` GPU layout a plan proposes (``run.gpus``).
- :mod:`~stream_rl.planner.render` and :mod:`~stream_rl.planner.units`: the plan as text, figures with units.

Pure Python: importing the planner imports neither torch nor transformers.
"""

from stream_rl.planner.model_size import ModelShape, count_params, shape_from_hf_config
from stream_rl.planner.inputs import PlanInputs
from stream_rl.planner.plan import Plan, TrainerLaunch, make_plan
from stream_rl.planner.render import render_table

__all__ = ["ModelShape", "Plan", "PlanInputs", "TrainerLaunch", "count_params", "make_plan", "render_table",
           "shape_from_hf_config"]
