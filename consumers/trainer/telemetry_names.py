"""Which of the trainer's per-step metrics its telemetry judges and exports: the trainer's names, kept here so the
generic telemetry layer (:mod:`stream_rl.telemetry`) takes names and values it is given and knows none of them.

Consumes: the metrics of one optimizer step (``train_step`` + rollout metrics, keys such as ``loss/total``) and
the ``metrics.jsonl`` row written for it.
Produces: the alert observation of the step (:func:`step_alert_values`) and the series exported as
``stream_rl_trainer_metric{name}`` (:func:`exported_metrics`).
Guarantees::

    step_alert_values(m) = {k: m[k] for k in STEP_ALERT_KEYS if m[k] is a number}     NaN/Inf kept: the
                                                                                      non-finite alerts judge them
    exported_metrics(row) = row without ROW_BOOKKEEPING_KEYS ("step", "time")

The step number itself is exported as ``stream_rl_trainer_step``; the row's wall time is not a metric.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STEP_ALERT_KEYS = ("loss/total", "optim/grad_norm", "kl/ref_mean", "reward/mean", "mismatch/logp_abs_diff")
"""The per-step keys the alert rules judge (``stream_rl.alerts.rules``): one sample each per step."""

ROW_BOOKKEEPING_KEYS = ("step", "time")
"""Keys of a ``metrics.jsonl`` row that are not exported as ``stream_rl_trainer_metric``."""


def step_alert_values(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The step's values for the alert observation made right after it (numbers only, non-finite included)."""
    return {k: metrics[k] for k in STEP_ALERT_KEYS if isinstance(metrics.get(k), (int, float))}


def exported_metrics(row: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a ``metrics.jsonl`` row exported as ``stream_rl_trainer_metric{name}``."""
    return {k: v for k, v in row.items() if k not in ROW_BOOKKEEPING_KEYS}
