"""Experiment trackers (TensorBoard, Weights & Biases, MLflow) behind one small interface, imported lazily.

Consumes: tracker names (``telemetry.trackers``).
Produces: :data:`TRACKER_PACKAGES`, :func:`missing_packages` (used when the config is validated) and
:func:`backend` (the backend class of a name, imported on demand).
Guarantees: importing this package imports no tracker library; :func:`missing_packages` asks
``importlib.util.find_spec`` only. The parts: :mod:`.base` (the interface and pure helpers), one module per backend
(:mod:`.tensorboard_backend`, :mod:`.wandb_backend`, :mod:`.mlflow_backend`), :mod:`.worker` (one background thread
per tracker) and :mod:`.fanout` (what the trainer holds).
"""

from __future__ import annotations

import importlib
import importlib.util

TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The Python package each tracker needs (extra ``.[trackers]``)."""
_BACKENDS = {"tensorboard": ("tensorboard_backend", "TensorBoardTracker"),
             "wandb": ("wandb_backend", "WandbTracker"), "mlflow": ("mlflow_backend", "MlflowTracker")}


def missing_packages(names: list[str]) -> list[str]:
    """``"<tracker> (package <pkg>)"`` for each tracker in ``names`` whose package cannot be found."""
    out = []
    for name in names:
        package = TRACKER_PACKAGES[name]
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # a parent missing, or a module set to None in sys.modules
            found = False
        if not found:
            out.append(f"tracker {name} (package {package})")
    return out


def backend(name: str) -> type:
    """The tracker class for ``name`` (its module, and so its library, is imported now)."""
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
