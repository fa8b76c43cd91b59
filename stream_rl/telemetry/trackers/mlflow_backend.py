"""MLflow: a local store under ``tracker_dir/mlruns`` or the server of ``MLFLOW_TRACKING_URI`` (``MlflowClient``).

Consumes: the calls of :class:`~stream_rl.telemetry.trackers.base.Tracker` from the tracker's thread.
Produces: one run (experiment ``tracker_project``, run name ``topics.run``) with the config as params (values cut
to MLflow's 6,000 characters), a metric per key per step (``log_batch``, ``trainer/step`` last; a name MLflow
refuses is rewritten by :func:`metric_name`), evaluations at their step, sample tables as JSON artifacts
``samples/step_<N>.json``.
Guarantees: ``open`` reports the highest step of ``trainer/step`` in the run's history (the store's own answer),
so a resumed run never logs a step twice. MLflow's client is told not to retry requests itself
(``MLFLOW_HTTP_REQUEST_MAX_RETRIES=0`` unless set): the worker's backoff does that without holding its thread for
minutes. The local store is MLflow's file store (``MLFLOW_ALLOW_FILE_STORE=true`` is set for it: mlflow-skinny
has no SQL store).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from typing import Any

from stream_rl.telemetry.trackers.base import STEP_KEY, Opened, Tracker

MAX_PARAM = 6000
BATCH = 900  # log_batch takes at most 1000 metrics
NOT_RETRIABLE = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE", "RESOURCE_DOES_NOT_EXIST"})
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_\-. :/]")


def metric_name(key: str) -> str:
    """A metric or param name as MLflow accepts it: ``@`` -> ``_at_`` (``eval/x/pass@8`` -> ``eval/x/pass_at_8``), any other
    character outside letters, digits, ``_ - . : /`` and space -> ``_``."""
    return _NOT_IN_NAME.sub("_", key.replace("@", "_at_"))


class MlflowTracker(Tracker):
    name = "mlflow"

    def open(self, run_id: str | None, purge_from: int | None) -> Opened:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (self.directory / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            exp = self.client.get_experiment_by_name(self.project)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.project)
            run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        held = [m.step for m in self.client.get_metric_history(run_id, STEP_KEY)]
        return Opened(run_id, max(held, default=0))

    def log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        todo = [Param(metric_name(k), v[:MAX_PARAM]) for k, v in sorted(params.items())
                if metric_name(k) not in existing]
        for i in range(0, len(todo), 90):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=todo[i:i + 90])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(metric_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + BATCH])

    def log_evaluation(self, step: int, metrics: Mapping[str, float]) -> None:
        self.log_metrics(step, metrics)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.client.log_dict(self.run_id, rows, f"samples/step_{step:08d}.json")

    def retriable(self, exc: BaseException) -> bool:
        """A request the server refused for its content is not sent again; an unreachable server is retried."""
        return getattr(exc, "error_code", None) not in NOT_RETRIABLE

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
